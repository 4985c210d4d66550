"""Config loading: YAML (accelerate keys + dualrun keys) -> validated, frozen JobConfig."""
from dualrun.config.load import load_config, build_config
from dualrun.config.model import JobConfig, RoleSpec, RayOptions, TorchrunOptions

__all__ = ["load_config", "build_config", "JobConfig", "RoleSpec", "RayOptions", "TorchrunOptions"]
