"""The hooks dualrun/servers/warm_first_calls.py uses are this vLLM's and this torch's own: vLLM's CPU worker has the
model warm-up the probe follows and has imported the probe's module, and the probe fills the cache inductor's first
CPU compile reads (a vLLM or torch that renames one fails this test, not a job: the first request then probes). In a
fresh interpreter, as in a worker's process."""
from __future__ import annotations

import json
import subprocess
import sys

from vllm_helpers import TIER

pytestmark = TIER

PROBE = r"""
import importlib, json, sys
from dualrun.servers import warm_first_calls as w
cls = getattr(importlib.import_module(w.WORKER_CLASS[0]), w.WORKER_CLASS[1])
imported = w.VEC_ISA[0] in sys.modules
isa = importlib.import_module(w.VEC_ISA[0])
before = isa.valid_vec_isa_list.cache_info().currsize
warmed = w.warm()
print(json.dumps({"warm_up": callable(getattr(cls, "compile_or_warm_up_model", None)), "imported": imported,
                  "before": before, "warmed": warmed, "after": isa.valid_vec_isa_list.cache_info().currsize,
                  "picked": str(isa.pick_vec_isa()), "hits": isa.valid_vec_isa_list.cache_info().hits}))
"""


def test_the_probe_fills_inductors_isa_cache_in_a_cpu_worker_process():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["warm_up"]    # the CPU worker's step the probe follows
    assert got["imported"]   # the worker has the probe's module already: the thread imports nothing new
    assert got["before"] == 0 and got["warmed"] and got["after"] == 1   # probed once
    assert got["hits"] >= 1  # pick_vec_isa (the first compile's call) answered from the cache
