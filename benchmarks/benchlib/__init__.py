"""What the benchmark scripts share, one job per module, so each script is only its own experiment:

  sandbox   refuse to run (or re-execute under `unshare -n`) unless only the loopback interface is visible
  noise     the machine a result was taken on, and how busy other jobs keep it
  job       the tiny SFT job and the command line of each launcher that runs it
  measure   one launcher run measured from outside (wall, first step, driver RSS and CPU, CPU by kind of process)
  phases    the worker-side probe's records (benchmarks/probe/): phases and steady-state steps
  cluster   a running local Ray cluster the benchmark starts and stops itself
  report    the launch tables, chart and the README blocks they refresh
  planner   the planner timed at 1,024 GPUs
  servers   servers a benchmark starts: stub replicas, CPU engines, dualrun's router or vllm-router before them
  stub      a replica that answers at once (run as a process by servers.start_stubs)
  load      closed-loop HTTP load: N requests in flight, each one's latency, requests/s
  proctree  CPU-seconds of every process of a launch's tree, sampled from /proc while it runs

Imported as `benchlib` with benchmarks/ on sys.path (as it is for `python benchmarks/<script>.py`).
"""
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent   # benchmarks/
REPO = BENCH.parent
RESULTS = BENCH / "results"
