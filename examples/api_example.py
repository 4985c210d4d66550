"""The Python API: `dualrun.launch(fn_or_script, config=..., backend=...)` from your own program.

    python examples/api_example.py --backend torchrun
    python examples/api_example.py --backend ray            # joins a running Ray cluster, else starts one
    python examples/api_example.py --backend ray --tiny /tmp/tiny --out /tmp/api-out

Two jobs, each on 2 CPU workers (gloo), the same code on both backends:

1. a *function*: every worker runs `train_linear(steps, lr)` — a tiny data-parallel regression with
   torch.distributed — and its return value comes back to this program, per rank
   (`result.ranks[i].result`);
2. a *script*: the unchanged TRL script `examples/sft.py` on a tiny model built offline
   (`examples/make_tiny_model.py`); a script has no return value, so the per-rank results are exit codes and
   the trained model is in `--output_dir`.

A failed job does not raise: `result.ok`, `result.exit_code` and `result.message` (which rank failed and why).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import dualrun

HERE = os.path.dirname(os.path.abspath(__file__))

# The config as a dict (a YAML path works the same): 2 CPU processes of the `train` role. Same for both backends.
CONFIG = {"use_cpu": True, "method": "sft", "roles": {"train": {"gpus": 2}}}


def train_linear(steps: int, lr: float) -> dict:
    """Runs on every worker, with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT already set by dualrun.

    Defined in the launching program: it is pickled by value, so the workers need nothing but this function."""
    import os

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(100 + rank)   # each rank its own shard of data
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.25
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()          # DDP averages the gradients over the ranks
        opt.step()
    weights = [round(w, 6) for w in model.module.weight.detach().flatten().tolist()]
    dist.destroy_process_group()
    return {"rank": rank, "world_size": world, "loss": round(loss.item(), 6), "weights": weights,
            "backend": os.environ["DUALRUN_BACKEND"], "node_rank": int(os.environ["NODE_RANK"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["torchrun", "ray"], default="torchrun")
    parser.add_argument("--tiny", help="tiny model folder (made with examples/make_tiny_model.py when missing)")
    parser.add_argument("--out", help="output folder of the SFT run (default: a temporary folder)")
    parser.add_argument("--skip_script", action="store_true", help="run only the function job")
    args = parser.parse_args(argv)

    # 1. a function: per-rank return values
    result = dualrun.launch(train_linear, config=CONFIG, backend=args.backend, fn_args=(20,),
                            fn_kwargs={"lr": 0.05})
    if not result.ok:
        print(f"function job failed: {result.message}", file=sys.stderr)
        return result.exit_code
    for r in result.ranks:
        print(f"{r.label}: {r.result}")
    # data-parallel training keeps the replicas identical
    assert len({tuple(r.result["weights"]) for r in result.ranks}) == 1
    summary = {"function": [r.result for r in result.ranks]}

    # 2. a script: the unchanged TRL script, per-rank exit codes
    if not args.skip_script:
        tiny = args.tiny or os.path.join(tempfile.gettempdir(), "tiny")
        subprocess.run([sys.executable, os.path.join(HERE, "make_tiny_model.py"), "--out", tiny], check=True)
        out = args.out or tempfile.mkdtemp(prefix="dualrun-api-sft-")
        result = dualrun.launch(os.path.join(HERE, "sft.py"), [
            "--model_name_or_path", os.path.join(tiny, "model"), "--dataset_path",
            os.path.join(tiny, "data", "sft.jsonl"), "--output_dir", out, "--max_steps", "2"],
            config=CONFIG, backend=args.backend)
        print(f"script job: ok={result.ok} exit_code={result.exit_code} wall_time={result.wall_time_s:.1f}s "
              f"ranks={[(r.label, r.exit_code) for r in result.ranks]}")
        if not result.ok:
            print(f"script job failed: {result.message}", file=sys.stderr)
            return result.exit_code
        with open(os.path.join(out, "trainer_state.json")) as f:
            history = json.load(f)["log_history"]
        summary["script"] = {"exit_codes": [r.exit_code for r in result.ranks],
                             "losses": [h["loss"] for h in history if "loss" in h], "output_dir": out}
    print("SUMMARY " + json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
