"""Seconds per full weight sync (GRPO's, over dualrun's gloo path) to 1 and 2 real vLLM CPU replicas behind the
router, against a plain gloo broadcast of the same bytes measured in the same run (the limit).

    bash scripts/in-loopback.sh .venv-vllm/bin/python benchmarks/weight_sync_bench.py   # ~15 min on 2 shared cores
    python benchmarks/weight_sync_bench.py --fake --out /tmp/ws.md --chart /tmp/ws.png  # synthetic numbers

Per model (the tiny vLLM model of examples/make_tiny_model.py --vllm, and a ~100M-parameter Llama built here from a
config, random weights, the tiny tokenizer; nothing downloaded) and layout (1, then 2 replicas), vLLM CPU servers
start as dualrun starts a rollout (`dualrun.methods.commands.rollout_vllm`: TRL's flags, `--weight-transfer-config
{"backend": "gloo"}`; each its share of the cores, as dualrun/servers/cpu_share.py gives it) behind dualrun's
router (`dualrun.programs.router`). TRL 1.16's unchanged `VLLMClient` with dualrun's gloo path installed (as GRPO's
rank hook installs it) opens the weight-sync group (`init_communicator`), syncs once untimed, then `--reps` times
does what GRPOTrainer's `sync_weights` does (`update_named_params` of every parameter, then `reset_prefix_cache`),
each time right after a plain torch.distributed gloo broadcast of the same packed chunks from this process to one
receiver process per replica. Then every parameter is perturbed and synced once more, and each replica's
log-probabilities of a fixed prompt are compared with this model's (the weights landed).

Where the time goes: this process times the HTTP calls and reads the trainer's stream stats (packing, waiting for
the wire); inside each vLLM worker, benchmarks/benchlib/weight_sync_timing.py (a `--worker-extension-cls`) reads the
engine's receiver stats and times the layerwise-reload start/finish, from the server logs. `--wire-json` adds
benchmarks/weight_sync_wire.py's tables (the wire alone, loopback and shaped links). Writes results/weight_sync.md
and results/weight_sync.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from benchlib.cpu import CpuMeter  # noqa: E402
from benchlib.noise import versions  # noqa: E402,F401 - also quiet_readers_bench's
from benchlib.servers import start_router  # noqa: E402

OUT = os.path.join(BENCH, "results", "weight_sync.md")
CHART = os.path.join(BENCH, "results", "weight_sync.png")
# The vLLM tier's CPU settings (tests/support/vllm_helpers.py): eager float32, a 1 GiB KV cache; timing extension added.
# Each server's cores as dualrun's launch gives them (dualrun/servers/cpu_share.py): one replica all of them, two
# replicas one share each.
SERVER_ARGS = ("--enforce-eager", "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
               "--worker-extension-cls", "benchlib.weight_sync_timing.TimingExtension")
# dualrun's quiet readers, as the plan marks every vLLM CPU engine (dualrun/servers/quiet_readers.py).
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "DUALRUN_VLLM_QUIET_READERS": "1"}
# The engines at rest before the plain broadcast is timed: a reader still spinning after the sync before (vLLM's
# own spin a second, dualrun's quiet readers' 20 ms) would take the broadcast's cores and flatter the sync's ratio.
SETTLE_S = 1.2
# ~100M parameters: 8 layers of hidden 1024 (16 heads of 64, a head size vLLM's CPU attention supports).
BIG = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
       "num_key_value_heads": 16, "head_dim": 64}


# -- models -----------------------------------------------------------------------------------------------------
def build_models(work: str, which: list[str]) -> dict[str, str]:
    """{name: model dir}: the tiny vLLM model, and the ~100M one from its config and tokenizer."""
    subprocess.run([sys.executable, os.path.join(ROOT, "examples", "make_tiny_model.py"), "--vllm", "--out",
                    os.path.join(work, "tiny")], check=True, capture_output=True)
    tiny = os.path.join(work, "tiny", "model")
    models = {"tiny": tiny}
    if "100M" in which:
        import torch
        from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

        config = AutoConfig.from_pretrained(tiny)
        for key, value in BIG.items():
            setattr(config, key, value)
        torch.manual_seed(0)
        big = os.path.join(work, "big")
        LlamaForCausalLM(config).save_pretrained(big)
        AutoTokenizer.from_pretrained(tiny).save_pretrained(big)
        models["100M"] = big
    return {k: v for k, v in models.items() if k in which}


# -- servers ----------------------------------------------------------------------------------------------------
def start_servers(model: str, n: int, log_dir: str, stack: list, env_extra: dict | None = None) -> list:
    from dualrun.config.model import RoleSpec
    from dualrun.contract.protocol import CPU_SHARE
    from dualrun.light.ports import free_port
    from dualrun.config.engine_kinds import HEALTH_PATH
    from dualrun.methods.commands import for_installed_vllm, rollout_vllm
    from dualrun.config.engine_kinds import VLLM
    from dualrun.servers.process import ServerProcess

    role = RoleSpec("rollout", 1, 1, engine="vllm", model=model, server_args=SERVER_ARGS)
    env = {**os.environ, **VLLM.weight_env, **SERVER_ENV, **(env_extra or {}),
           "PYTHONPATH": os.pathsep.join(p for p in (BENCH, ROOT, os.environ.get("PYTHONPATH")) if p)}
    servers = []
    for i in range(n):
        port = free_port()
        argv = for_installed_vllm(rollout_vllm(role, model, "127.0.0.1", port))
        log = os.path.join(log_dir, f"{os.path.basename(model)}-{n}-server-{i}.log")
        servers.append(ServerProcess(f"server {i}", argv, {**env, CPU_SHARE: f"{i}/{n}"}, "127.0.0.1", port,
                                     HEALTH_PATH, 900, log_path=log, stream=None).start())
        stack.append(servers[-1])
    for s in servers:
        s.wait_healthy()
    return servers


def server_timings(log_path: str) -> list[dict]:
    """Pure: one dict per weight update a server logged (benchmarks/benchlib/weight_sync_timing.py's lines), in order."""
    from benchlib.weight_sync_timing import MARK

    syncs, current = [], {}
    with open(log_path) as f:
        for line in f:
            if not line.startswith(MARK):
                continue
            rec = json.loads(line[len(MARK):])
            if rec["phase"] == "update":
                current.update(recv=rec["recv_s"], load=rec["load_s"], relay=rec["wait_s"], update=rec["s"],
                               bytes=rec["bytes"])
            else:
                current[rec["phase"]] = rec["s"]
            if rec["phase"] == "finish":
                syncs.append(current)
                current = {}
    return syncs


# -- the plain broadcast (the limit) ----------------------------------------------------------------------------
class Baseline:
    """This process (rank 0) and one receiver process per replica in a plain torch.distributed gloo group: the
    same chunks the sync sends, broadcast as they are (no packing, no loading; every buffer allocated once, at both
    ends), a barrier at each end."""

    def __init__(self, chunk_bytes: list[int], receivers: int, rounds: int) -> None:
        self.chunk_bytes, self.receivers, self.rounds = chunk_bytes, receivers, rounds
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "Baseline":
        import torch
        import torch.distributed as dist

        from dualrun.light.ports import free_port

        port, world = free_port(), self.receivers + 1
        sizes = ",".join(map(str, self.chunk_bytes))
        self.procs = [subprocess.Popen([sys.executable, __file__, "--receiver", str(rank), str(world), str(port),
                                        str(self.rounds), sizes]) for rank in range(1, world)]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world)
        self.chunks = [torch.ones(n, dtype=torch.uint8) for n in self.chunk_bytes]
        return self

    def measure(self) -> float:
        import torch.distributed as dist

        dist.barrier()
        t0 = time.perf_counter()
        for chunk in self.chunks:
            dist.broadcast(chunk, 0)
        dist.barrier()
        return time.perf_counter() - t0

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


def receiver(rank: int, world: int, port: int, rounds: int, sizes: list[int]) -> None:
    """A baseline receiver: takes each chunk's broadcast into a buffer of its own, allocated once."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    chunks = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(rounds):
        dist.barrier()
        for chunk in chunks:
            dist.broadcast(chunk, 0)
        dist.barrier()
    dist.destroy_process_group()


# -- the trainer's side -----------------------------------------------------------------------------------------
class TimedClient:
    """TRL's VLLMClient with dualrun's gloo path, as a GRPO rank has it, with each HTTP call and broadcast timed."""

    def __init__(self, url: str) -> None:
        import trl.generation.vllm_client as trl_client

        from dualrun.light.ports import free_port
        from dualrun.weightsync.trainer.vllm_client import install

        install(trl_client)
        self.client = trl_client.VLLMClient(base_url=url, group_port=free_port(), connection_timeout=120)
        self.posts: dict[str, float] = {}
        post = self.client._post

        def timed_post(url: str, **kwargs):
            t = time.perf_counter()
            try:
                return post(url, **kwargs)
            finally:
                self.posts[url.rsplit("/", 1)[-1]] = time.perf_counter() - t
        self.client._post = timed_post
        from dualrun.weightsync.trainer import regroup

        membership = regroup.membership

        def timed_membership(client):
            t = time.perf_counter()
            try:
                return membership(client)
            finally:
                self.posts["membership"] = time.perf_counter() - t
        regroup.membership = timed_membership   # the router's members, asked before every sync
        self.client.init_communicator(device="cpu")
        endpoint = self.client.communicator
        send = endpoint.send

        def timed_send(named):
            t = time.perf_counter()
            try:
                return send(named)
            finally:
                self.sent_at, self.send_s = time.perf_counter(), time.perf_counter() - t
        endpoint.send = timed_send
        self.sender = endpoint.sender

    def sync(self, model) -> dict:
        """GRPOTrainer's `sync_weights` in server mode: every parameter (packed), then the prefix-cache reset."""
        metadata = [(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in model.named_parameters()]
        self.posts.clear()
        t0 = time.perf_counter()
        self.client.update_named_params(metadata, ((n, p.data) for n, p in model.named_parameters()))
        t1 = time.perf_counter()
        self.client.reset_prefix_cache()
        total = time.perf_counter() - t0
        update = self.posts["update_weights"]
        stats = self.sender.stats
        return {"total": total, "membership": self.posts.get("membership", 0.0), "update_call": t1 - t0,
                "update_post": update, "start_post": self.posts["start_weight_update"], "pack": stats["pack_s"],
                "wire": stats["wait_s"], "send_other": self.send_s - stats["pack_s"] - stats["wait_s"],
                "update_tail": update - self.send_s, "finish_post": self.posts["finish_weight_update"],
                "reset_post": total - (t1 - t0), "chunks": stats["chunks"], "bytes": stats["bytes"]}

    def close(self) -> None:
        self.client.close_communicator()


# -- the weights landed --------------------------------------------------------------------------------------------
PROMPT = [2, 10, 11, 12, 13, 14]   # token ids of the tiny tokenizer's vocabulary (the 100M model shares it)
TOLERANCE = 1e-3                   # vLLM's CPU kernels against transformers', float32 (tests/support/vllm_helpers.py)


def served_logprobs(url: str) -> list[float]:
    """One engine's log-probabilities of PROMPT's tokens (vLLM's prompt_logprobs), the first left out."""
    import requests

    name = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": name, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}
    choice = requests.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]
    return [d[str(t)]["logprob"] for d, t in zip(choice["prompt_logprobs"][1:], PROMPT[1:])]


def own_logprobs(model) -> list[float]:
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, :-1].float(), -1)
    return [lp[i, t].item() for i, t in enumerate(PROMPT[1:])]


def landed(client: "TimedClient", model, servers: list) -> dict:
    """Perturb every parameter, sync, and compare each replica's log-probabilities with this model's: a sync that
    left any chunk wrong (a reused buffer overwritten before vLLM's layerwise reload copied it, a segment relayed out
    of order) moves them far past vLLM's kernels' own difference."""
    import torch

    before = own_logprobs(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    client.sync(model)
    after = own_logprobs(model)
    gaps = [max(abs(a - b) for a, b in zip(served_logprobs(f"http://{s.address}"), after)) for s in servers]
    moved = max(abs(a - b) for a, b in zip(after, before))
    if max(gaps) >= TOLERANCE or moved < 100 * TOLERANCE:
        raise RuntimeError(f"the sync did not land: replicas' log-probability gaps {gaps}, the model moved {moved}")
    return {"gaps": gaps, "moved": moved}


def chunk_sizes(model) -> list[int]:
    """The packed chunks' sizes in bytes, cut as the gloo path cuts them (dualrun.weightsync.wire)."""
    from dualrun.weightsync.wire import PACKED_BUFFER_BYTES, chunk_bounds

    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    return [sum(sizes[a:b]) for a, b in chunk_bounds(sizes, PACKED_BUFFER_BYTES)]


def measure_model(name: str, path: str, reps: int, log_dir: str) -> list[dict]:
    """Both layouts of one model: a row per layout with every repetition's sync, baseline and server phases."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    chunks = chunk_sizes(model)
    rows = []
    for replicas in (1, 2):
        stack: list = []
        try:
            servers = start_servers(path, replicas, log_dir, stack)
            router = start_router(servers, stack)
            client = TimedClient(f"http://{router.address}")
            runs = []
            with Baseline(chunks, replicas, reps + 1) as base:
                base.measure()
                client.sync(model)   # warm-up: first-call costs
                meter = CpuMeter({"trainer": [os.getpid()], "receivers": [p.pid for p in base.procs],
                                  "engines": [s.proc.pid for s in servers], "router": [router.proc.pid]},
                                 alone=("trainer",))
                for _ in range(reps):
                    load = os.getloadavg()[0]
                    time.sleep(SETTLE_S)
                    meter.read()
                    baseline = base.measure()
                    cpu_baseline = meter.read()
                    synced = client.sync(model)
                    runs.append({"baseline": baseline, **synced, "load": load, "cpu_baseline": cpu_baseline,
                                 "cpu_sync": meter.read()})
            check = landed(client, model, servers)
            client.close()
            time.sleep(1)   # the servers' log lines are written by a reader thread
            per_server = [server_timings(s.log_path)[1:reps + 1] for s in servers]
            for i, run in enumerate(runs):
                run["server"] = [syncs[i] for syncs in per_server]
            rows.append({"model": name, "params": sum(p.numel() for p in model.parameters()),
                         "bytes": sum(chunks), "chunks": len(chunks), "replicas": replicas, "runs": runs,
                         "landed": check})
        finally:
            for s in reversed(stack):
                s.stop(grace_s=5)
    return rows



def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--receiver"]:
        rank, world, port, rounds = map(int, argv[1:5])
        receiver(rank, world, port, rounds, [int(n) for n in argv[5].split(",")])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--models", default="tiny,100M", help="comma-separated: tiny, 100M")
    p.add_argument("--out", default=OUT)
    p.add_argument("--json", default=None, help="also write every repetition's numbers here")
    p.add_argument("--keep-logs", default=None, help="a directory for the servers' logs (default: a temp dir)")
    p.add_argument("--from-json", default=None, help="re-write the report from a --json file of an earlier run")
    p.add_argument("--wire-json", action="append", default=[],
                   help="weight_sync_wire.py's --json output (loopback or shaped links) for the report; repeatable")
    p.add_argument("--chart", default=CHART, help="the chart's PNG (matplotlib)")
    p.add_argument("--fake", action="store_true", help="synthetic numbers, nothing started (the report's test)")
    args = p.parse_args(argv)
    which = args.models.split(",")
    saved: dict = {}
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        rows = saved["rows"]
    elif args.fake:
        from benchlib.weight_sync_report import fake_rows

        rows = fake_rows(args.reps)
    else:
        with tempfile.TemporaryDirectory(prefix="dualrun-wsync-") as work:   # the models (~400 MB): removed after
            log_dir = args.keep_logs or work
            os.makedirs(log_dir, exist_ok=True)
            models = build_models(work, which)
            rows = [row for name in which for row in measure_model(name, models[name], args.reps, log_dir)]
    load = os.getloadavg()
    meta = {"command": "bash scripts/in-loopback.sh .venv-vllm/bin/python benchmarks/weight_sync_bench.py"
            + (f" --models {args.models}" if args.models != "tiny,100M" else "")
            + (f" --reps {args.reps}" if args.reps != 3 else "") + (" --fake" if args.fake else ""),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "reps": args.reps,
            "load_end": f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1/5/15 min)", "versions": versions(),
            **saved.get("meta", {})}
    from benchlib.weight_sync_chart import chart
    from benchlib.weight_sync_report import fake_wire, report

    wire = fake_wire(args.reps) if args.fake else dict(saved.get("wire", {}))
    for path in args.wire_json:
        with open(path) as f:
            found = json.load(f)
        wire["loopback" if all(r["link"] == "loopback" for r in found["rows"]) else "shaped"] = found
    text = report(rows, meta, wire)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    chart(rows, wire, Path(args.chart))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows, "wire": wire}, f, indent=1)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
