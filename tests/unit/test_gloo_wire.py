"""The gloo weight transfer's wire (dualrun.weightsync.wire): pure, no vLLM. Both sides cut the packed stream
into the same chunks, or the worker would wait for bytes the trainer never sends. vLLM's own `pack_tensors` is
checked against it in the vLLM tier (test_vllm_rollout.py)."""
from __future__ import annotations

import subprocess
import sys

from dualrun.weightsync.wire import chunk_bounds


def test_a_chunk_ends_with_the_tensor_that_takes_it_past_the_buffer():
    assert chunk_bounds([4, 4, 4, 4], 8) == [(0, 3), (3, 4)]      # 4+4 = 8 is not past 8; +4 is
    assert chunk_bounds([10, 1, 1], 8) == [(0, 1), (1, 3)]        # a tensor bigger than the buffer is a chunk alone
    assert chunk_bounds([1, 1], 8) == [(0, 2)]
    assert chunk_bounds([], 8) == []


def test_the_plugin_module_imports_neither_vllm_nor_torch():
    """vLLM loads it in every one of its processes on a machine with dualrun installed, and dualrun's driver imports
    it for the backend's name: it is standard library only, and registering adds one entry to vLLM's registry (the
    engine module loads only when a server asks for `gloo`)."""
    code = ("import sys, dualrun.weightsync.engine.vllm_plugin, dualrun.weightsync.wire; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
