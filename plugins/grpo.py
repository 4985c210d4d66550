"""grpo: roles `train` and `rollout`. Colocated rollout generates inside the trainer (TRL's own path, or vLLM
colocate mode when vLLM is installed); a separate rollout runs `trl vllm-serve` on its own GPUs."""
from dualrun.plugin import MethodPlugin


class GRPOPlugin(MethodPlugin):
    name = "grpo"
    roles = ("train", "rollout")
    required_roles = ("train",)


PLUGIN = GRPOPlugin
