"""gkd: roles `train`, `teacher` and optional `rollout`. A colocated teacher lives in the trainer processes;
a separate teacher is served on its own GPUs and the trainer asks it for top-k log-probabilities."""
from dualrun.plugin import MethodPlugin


class GKDPlugin(MethodPlugin):
    name = "gkd"
    roles = ("train", "teacher", "rollout")
    required_roles = ("train",)


PLUGIN = GKDPlugin
