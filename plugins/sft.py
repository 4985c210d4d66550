"""sft / pt: one `train` role; the unchanged Trainer / SFTTrainer runs in every rank."""
from dualrun.methods.plugin import MethodPlugin


class SFTPlugin(MethodPlugin):
    name = "sft"
    roles = ("train",)
    required_roles = ("train",)


PLUGIN = SFTPlugin
