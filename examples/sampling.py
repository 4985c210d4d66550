"""Sample N completions per prompt and score them (roles: sampler, prm, orm); write one JSONL row per completion.

The same file runs unchanged everywhere (it is a role program, see docs/roles.md):

    python examples/sampling.py --config configs/sampling_cpu.yaml --model M --prompts P --out out.jsonl
    dualrun launch --backend ray      --config_file configs/sampling_cpu.yaml examples/sampling.py --model M ...
    dualrun launch --backend torchrun --config_file configs/sampling_cpu.yaml examples/sampling.py --model M ...

It runs once, as the driver; with Ray the sampler/prm/orm groups are actors on their roles' devices, otherwise
each worker of a group of several is a child process of this one (a group of one runs in this process).
`--prm` / `--orm` take a model path or a reward function (`contains_answer`, `step_length`, `pkg.mod:fn`).
A role's `model:` in the config is the default for --model / --prm / --orm.
"""
from __future__ import annotations

import argparse
import json
import os

import dualrun
from dualrun.plugins.sampling import run_sampling


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="config for plain `python` runs (dualrun launch passes its own)")
    p.add_argument("--model", default=None, help="sampler model (default: roles.sampler.model)")
    p.add_argument("--prompts", required=True, help="JSONL with a `prompt` (text or chat messages) per row")
    p.add_argument("--out", required=True, help="output JSONL")
    p.add_argument("--num_completions", type=int, default=4, help="completions per prompt")
    p.add_argument("--max_new_tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="use only the first LIMIT prompts")
    p.add_argument("--prm", default=None, help="process reward: model path or function (default: roles.prm.model)")
    p.add_argument("--orm", default=None, help="outcome reward: model path or function (default: roles.orm.model)")
    args = p.parse_args()

    runtime = dualrun.init(args.config) if args.config else dualrun.get_runtime()
    role_model = lambda name: (runtime.spec.group(name).model if runtime.spec.group(name) else None)  # noqa: E731
    model = args.model or role_model("sampler")
    if not model:
        p.error("--model is required (or set roles.sampler.model in the config)")
    with open(args.prompts, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()][: args.limit]
    samples = run_sampling(rows, model, args.num_completions, args.max_new_tokens, args.temperature, args.seed,
                           prm=args.prm or role_model("prm"), orm=args.orm or role_model("orm"),
                           engine=runtime.spec.group("sampler").engine if runtime.spec.group("sampler") else None)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)   # the program runs once, on any backend
    with open(args.out, "w", encoding="utf-8") as f:
        for row in samples:
            f.write(json.dumps(row, sort_keys=True) + "\n")
    print(f"wrote {len(samples)} scored completions of {len(rows)} prompts to {args.out}")
    dualrun.shutdown()


if __name__ == "__main__":
    main()
