"""dualrun: run unchanged Hugging Face / TRL training scripts on torchrun or Ray by changing one flag."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
