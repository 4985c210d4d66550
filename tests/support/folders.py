"""Which folder of tests/ a test belongs in, by its markers (tests/README.md's table), so `ls tests` stays true: the
scripts pick the vLLM and cluster tiers by folder (scripts/test-vllm.sh, scripts/test-cluster.sh), and a test in the
wrong one would run in no tier or in the wrong venv. tests/conftest.py refuses a collection with a misplaced test.
No folder is named as a module the code imports (`vllm/` would be the namespace package `vllm` for every test, since
tests/ is on sys.path): the vLLM tier's is `vllm_tier/`."""
from __future__ import annotations

from collections.abc import Iterable

# each folder: the markers its tests may not carry, and those they must carry
NOT_HERE = {"unit": ("e2e", "vllm", "cluster"), "e2e": ("vllm", "cluster"), "vllm_tier": (), "cluster": ()}
MUST = {"unit": (), "e2e": (), "vllm_tier": ("vllm",), "cluster": ("cluster",)}
FOLDERS = tuple(NOT_HERE)


def home(markers: Iterable[str]) -> str:
    """The folder for a test with `markers`: the slowest tier's. One marked both `vllm` and `cluster` goes where the
    script that should run it looks: tests/vllm_tier/ (the vLLM tier) or tests/cluster/ (the cluster tier's vLLM
    part)."""
    found = set(markers)
    if {"vllm", "cluster"} <= found:
        return "tests/vllm_tier/ or tests/cluster/"
    for marker, folder in (("cluster", "cluster"), ("vllm", "vllm_tier"), ("e2e", "e2e")):
        if marker in found:
            return f"tests/{folder}/"
    return "tests/unit/"


def misplaced(parts: tuple[str, ...], markers: Iterable[str]) -> str | None:
    """Why a test at tests/<parts...> with `markers` is in the wrong folder, or None (`parts`: folder, file)."""
    found = set(markers)
    folder = parts[0] if len(parts) > 1 else None
    if folder not in FOLDERS:
        return f"a test outside the tiers' folders: its folder is {home(found)}"
    extra = [m for m in NOT_HERE[folder] if m in found]
    missing = [m for m in MUST[folder] if m not in found]
    if extra or missing:
        why = f"marked {', '.join(extra)}" if extra else f"not marked {', '.join(missing)}"
        return f"{why}: its folder is {home(found)}, not tests/{folder}/"
    return None
