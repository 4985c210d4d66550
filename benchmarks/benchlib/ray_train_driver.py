"""Reference launch through Ray Train: a `TorchTrainer` whose `train_loop_per_worker` runs an unchanged script.

    RAY_ADDRESS=127.0.0.1:6379 python benchmarks/benchlib/ray_train_driver.py --num-workers 2 script.py --its --args

This is what a Ray user writes to run an existing HF/TRL script on a running cluster without dualrun: connect,
give every worker the script's env through `runtime_env`, let Ray Train set up the gloo process group and the
rank variables, and run the script with `runpy` as `__main__` inside each worker. Used by `launch_bench.py` as the
"Ray Train" variant; kept free of dualrun on purpose.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile


def train_loop_per_worker(config: dict) -> None:
    import runpy

    if os.environ.get("DUALRUN_BENCH_PHASES"):   # launch_bench.py's probe (benchmarks/probe/): this worker was
        import importlib                          # started before RANK existed, so activate it here

        try:
            probe = importlib.import_module("sitecustomize")
        except ImportError:   # growth_bench.py: the rank script records its own times
            probe = None
        if hasattr(probe, "activate"):
            probe.activate()

    sys.argv = [config["script"]] + list(config["args"])
    os.chdir(config["cwd"])
    sys.path.insert(0, os.path.dirname(os.path.abspath(config["script"])))
    runpy.run_path(config["script"], run_name="__main__")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS") or "auto")
    p.add_argument("--cpus-per-worker", type=float, default=1.0,
                   help="logical CPUs per worker (growth_bench.py: 0.001, so 64 workers fit on 2 cores)")
    p.add_argument("--storage", default=None, help="Ray Train storage_path (default: a temp dir, removed after)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args()

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    env = {k: v for k, v in os.environ.items()
           if k.startswith(("ACCELERATE_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "PYTHON", "OMP_", "DUALRUN_BENCH_"))}
    ray.init(address=a.address, runtime_env={"env_vars": env})
    storage = a.storage or tempfile.mkdtemp(prefix="rtb-")
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"script": os.path.abspath(a.script), "args": a.args, "cwd": os.getcwd()},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=a.num_workers, use_gpu=False,
                                     resources_per_worker={"CPU": a.cpus_per_worker}),
        run_config=RunConfig(storage_path=storage, name="bench"),
    )
    trainer.fit()
    ray.shutdown()


if __name__ == "__main__":
    main()
