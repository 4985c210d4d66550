"""A replica joining a running GRPO job (`dualrun scale`) against a whole-job restart to the same step; the weight
sync's time with 1, 2 and 4 members after growth.

    bash scripts/in-loopback.sh .venv-vllm/bin/python benchmarks/fleet_growth.py --reps 2   # ~8-10 min on 2 cores
    bash scripts/in-loopback.sh .venv-vllm/bin/python benchmarks/fleet_growth.py --quick    # 1 rep, grow to 2 only
    python benchmarks/fleet_growth.py --fake --out /tmp/fg.md                               # synthetic numbers

On one machine there are no nodes to join: a grow by `dualrun scale rollout N` stands for one (it starts a spare
replica, as a node's room would on Ray). Each repetition:

1. `dualrun launch --backend torchrun` of TRL's unchanged GRPOTrainer (benchlib/fleet_rank.py, 1 rank, checkpoint
   every step) with a vLLM CPU rollout fleet: 1 replica started, `min_replicas: 1`, `max_replicas: 4` (the vLLM
   tier's CPU settings, one engine process each). `--syncs` syncs timed at 1 member.
2. `dualrun scale rollout 2`: the ask -> the supervisor's "serving from step S, N s after the resize asked for it" (the
   new engine started beside the other, held out of rotation until the next sync gave it the trainer's weights), the
   CLI's wall, the trainer's steps meanwhile; then `--syncs` syncs at 2 members. The same for 4 (3, then 4: one
   replica a grow unless `--at-once`) when the memory allows.
3. The restart: once the newest checkpoint is the last step logged, SIGTERM to the launch; when it is gone the same
   launch with a fixed fleet of 2 and the trainer resuming from that checkpoint. From the SIGTERM: the restarted
   job's first sync done (its replicas serving the trainer's weights again) and its first step past the last one
   logged before; then `--syncs` syncs of that fixed fleet, and it is stopped (OUT/stop).

Every sync is timed inside the rank (`sync_weights`, with the router's weight-sync members after it). Writes
results/fleet_growth.md (and --json: every number).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from benchlib.fleet_growth_report import fake_reps, report  # noqa: E402
from benchlib.noise import loadavg, machine, versions  # noqa: E402

OUT = BENCH / "results" / "fleet_growth.md"
RANK = BENCH / "benchlib" / "fleet_rank.py"
# The vLLM tier's CPU settings (tests/support/vllm_helpers.py): eager float32, a 1 GiB KV cache, the model worker
# inside the engine-core process (one process fewer per engine: 4 engines fit beside the other jobs' memory).
SERVER = ("engine: vllm, health_timeout_s: 400, server_args: [--enforce-eager, --dtype, float32, --max-model-len, "
          "'256', --max-num-seqs, '8'], env: {VLLM_CPU_KVCACHE_SPACE: '1', VLLM_ENABLE_V1_MULTIPROCESSING: '0'}")
ENGINE_GIB = 3.0       # what one more engine may need (a grow is skipped below that much available, plus MARGIN)
MARGIN_GIB = 1.5
WAIT_S = 600           # a job's start, a grow, a restart: at most this long
JOINED = re.compile(r"dualrun: rollout server (\d+) joined at \S+, serving from [^,]+, ([\d.]+) s after the resize "
                    r"asked for it \(its engine started in ([\d.]+) s")
HEALTHY = re.compile(r"dualrun: rollout: server healthy at \S+ \(started in ([\d.]+) s\)")


class Job:
    """One `dualrun launch` of the rank script; its events (this launch's own, from the shared events file)."""

    def __init__(self, work: Path, name: str, model: str, data: str, replicas: int, high: int | None,
                 resume: bool, env: dict) -> None:
        self.dir, self.env = work / name, env
        self.dir.mkdir(parents=True)
        self.events_path = work / "events.jsonl"
        self.skip = len(self.events_path.read_text().splitlines()) if self.events_path.exists() else 0
        bounds = f", min_replicas: 1, max_replicas: {high}" if high else ""
        (self.dir / "job.yaml").write_text(
            "use_cpu: true\nmethod: grpo\nlog_dir: logs\nroles:\n  train: {gpus: 1}\n"
            f"  rollout: {{gpus: {replicas}, model: {model}, {SERVER}{bounds}}}\n")
        self.stderr_path = self.dir / "stderr.txt"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dualrun", "launch", "--backend", "torchrun", "--config_file", "job.yaml",
                 str(RANK), model, data, str(work / "out"), str(self.events_path), *(["--resume"] if resume else [])],
                cwd=self.dir, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def events(self) -> list[dict]:
        if not self.events_path.exists():
            return []
        return [json.loads(ln) for ln in self.events_path.read_text().splitlines()[self.skip:] if ln.endswith("}")]

    def wait_for(self, check, what: str, timeout: float = WAIT_S) -> list[dict]:
        """Poll the events until `check(events)`; RuntimeError (with the launch's last lines) on exit or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            events = self.events()
            if check(events):
                return events
            if self.proc.poll() is not None:
                said = re.findall(r"dualrun: error: .*", self.stderr())
                raise RuntimeError(f"the job ended ({self.proc.returncode}) before {what}: "
                                   f"{said[-1][15:400] if said else ''}\n{self.stderr()[-3000:]}")
            time.sleep(0.1)
        raise RuntimeError(f"not within {timeout:g} s: {what}\n{self.stderr()[-3000:]}")

    def stop(self, grace_s: float = 60) -> None:
        """SIGTERM, then SIGKILL to its whole session after `grace_s`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def syncs_at(events: list[dict], members: int) -> list[dict]:
    """The syncs that reached `members` engines, in order."""
    return [e for e in events if e["kind"] == "sync" and e["members"] == members]


def last_step(events: list[dict]) -> int:
    return max((e["step"] for e in events if e["kind"] == "step"), default=0)


def rss_gib(root: int) -> float:
    """Resident memory of `root` and its descendants (every process of the job)."""
    from benchlib.measure import descendants

    total = 0
    for pid in descendants(root)[0] | {root}:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return round(total / 2**20, 2)


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def grow(job: Job, n: int, running: int, env: dict) -> dict:
    """`dualrun scale rollout n` against `job`: the joins' numbers from the launch's lines, the CLI's wall."""
    seen = {m.group(1) for m in JOINED.finditer(job.stderr())}
    before = last_step(job.events())
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "dualrun", "scale", "rollout", str(n)], env=env, capture_output=True,
                       text=True, timeout=WAIT_S)
    cli_s = time.time() - t0
    if r.returncode != 0:
        raise RuntimeError(f"dualrun scale rollout {n}: exit {r.returncode}: {(r.stdout + r.stderr)[-2000:]}")
    time.sleep(0.5)   # the launch's line is written by its own thread
    new = [m for m in JOINED.finditer(job.stderr()) if m.group(1) not in seen]
    if len(new) != n - running:
        raise RuntimeError(f"{n - running} joined lines expected, found {len(new)}:\n{job.stderr()[-3000:]}")
    return {"to": n, "serving_s": [float(m.group(2)) for m in new], "engine_s": [float(m.group(3)) for m in new],
            "cli_s": cli_s, "steps_during": last_step(job.events()) - before}


def timed(job: Job, members: int, syncs: int, reps: dict) -> None:
    """Wait for `syncs` syncs at `members` after the first one that reached them; their seconds into reps."""
    events = job.wait_for(lambda ev: len(syncs_at(ev, members)) > syncs, f"{syncs + 1} syncs with {members} members")
    at = syncs_at(events, members)
    reps["syncs"][str(members)] = [e["t1"] - e["t0"] for e in at[1:syncs + 1]]
    reps["rss_gib"][str(members)] = rss_gib(job.proc.pid)


def one_rep(work: Path, model: str, data: str, sizes: list[int], syncs: int, env: dict, at_once: bool) -> dict:
    rep: dict = {"load": loadavg()[0], "syncs": {}, "reforms": [], "rss_gib": {}, "joins": [], "skipped": []}
    jobs: list[Job] = []
    try:
        grown = Job(work, "grown", model, data, 1, max(sizes), False, env)
        jobs.append(grown)
        timed(grown, 1, syncs, rep)
        running = 1
        for n in sizes[1:]:
            if available_gib() < (n - running) * ENGINE_GIB + MARGIN_GIB:
                rep["skipped"] += [m for m in sizes if m >= n]
                break
            if n == sizes[1]:   # the trainer's pace before the first grow: what a step costs it, alone with 1
                steps = [e["t"] for e in grown.events() if e["kind"] == "step"][-6:]
                rep["step_before_s"] = statistics.median(b - a for a, b in zip(steps, steps[1:]))
            for m in [n] if at_once else range(running + 1, n + 1):   # one replica a grow: see NOTES
                rep["joins"].append(grow(grown, m, running, env))
                running = m
            timed(grown, n, syncs, rep)
        syncs_seen = [e for e in grown.events() if e["kind"] == "sync"]
        rep["reforms"] = [{"members": b["members"], "s": b["t1"] - b["t0"]}
                          for a, b in zip(syncs_seen, syncs_seen[1:]) if b["members"] != a["members"]]
        # the restart: once the newest checkpoint is the last step logged (nothing redone but the step under way)
        to = sizes[1] if len(sizes) > 1 else 1
        ckpts = work / "out" / "grpo"

        def settled(ev: list[dict]) -> bool:
            step = last_step(ev)
            return (ckpts / f"checkpoint-{step}" / "trainer_state.json").exists()
        events = grown.wait_for(settled, "a checkpoint of the last step logged")
        killed_after = last_step(events)
        t_kill = time.time()
        grown.stop()
        stop_s = time.time() - t_kill
        again = Job(work, "restarted", model, data, to, None, True, env)
        jobs.append(again)
        events = again.wait_for(lambda ev: any(e["kind"] == "step" and e["step"] > killed_after for e in ev),
                                "the restarted job's next step")
        start = next(e for e in events if e["kind"] == "start")
        first_sync = next(e for e in events if e["kind"] == "sync")
        healthy = HEALTHY.search(again.stderr())
        rep["restart"] = {"to": to, "stop_s": stop_s, "serving_s": first_sync["t1"] - t_kill,
                          "step_s": next(e["t"] for e in events if e["kind"] == "step" and e["step"] > killed_after)
                          - t_kill, "healthy_s": float(healthy.group(1)) if healthy else None,
                          "killed_after_step": killed_after, "resumed": start["resumed"]}
        events = again.wait_for(lambda ev: len(syncs_at(ev, to)) > syncs, f"{syncs + 1} syncs of the fixed fleet")
        rep["fixed_syncs"] = [e["t1"] - e["t0"] for e in syncs_at(events, to)[1:syncs + 1]]
        (work / "out" / "stop").touch()
        if again.proc.wait(timeout=120) != 0:
            raise RuntimeError(f"the restarted job ended {again.proc.returncode}:\n{again.stderr()[-3000:]}")
        return rep
    finally:
        for job in jobs:
            job.stop(grace_s=30)



NOTES = [
    "- **vLLM, not dualrun's CPU engine**: the CPU engine (`engine: transformers`) has no weight-transfer endpoints, "
    "so a replica on it cannot join with the trainer's weights; the rollout is vLLM's CPU build, as in the vLLM tier.",
    "- **The tiny model** (examples/make_tiny_model.py --vllm, well under 1 MB of weights): a sync's bytes are "
    "nothing, so its time is the fixed cost per member (the router's fan-out of the update's calls, each engine's "
    "receive, load and reload on the shared cores). The bytes-bound case, a ~100M model on shaped links, is "
    "results/weight_sync.md. `--model` takes another model vLLM can serve.",
    "- **One engine process each** (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and a 1 GiB KV cache: so that 4 engines, the "
    "trainer and the other jobs on this 24 GiB machine fit; a grow is skipped when the memory available is short.",
    "- **A grow could end the job** (why a repetition may fail, and `--retries`): before the fix below the router's "
    "weight-transfer members changed the moment a replica was started, not between syncs. (1) Started while an update is open (after its "
    "`start_weight_update`, before its `finish_weight_update`): the new replica gets only the finish, vLLM answers "
    "500 (\"finish_weight_update called without a matching start_weight_update\"), the router 502, TRL's client "
    "retries the finish on every member, all now refuse it, and the trainer fails (RetryError). (2) Started while "
    "the trainer re-forms the group for another (2 -> 4 in one ask): the trainer had read the world size before, "
    "the router's `init_weight_transfer_engine` fan-out counted one member more, the engines refused it "
    "(\"init_info.world_size 4 cannot hold rank_offset 1 plus the 4 workers\") and the trainer waited out "
    "`weight_sync_timeout_s` (120 s): GroupNotFormed. Seen at git cd4dd33 in 3 of 18 asks (1) and in 1 of 3 asks "
    "growing 2 -> 4 at once (2); so the default grows one replica at a time (`--at-once`: in one ask). Fixed "
    "since: the weight-sync group is a snapshot changed only by a re-form, and a replica joining mid-sync waits, "
    "held, for the next one (docs/fleets.md, \"Growing: weights first\").",
    "- **Reading it**: on one machine the joining engine starts on the cores the trainer and the serving engines "
    "use, so joining is no faster than a restart whose engines start before any training; a node that joins brings "
    "its own. What the join saves is the training: it goes on meanwhile (the steps taken, the time lost), and a "
    "restart stands still. With every engine on the same 2 cores, the sync's time per member is each engine's CPU "
    "work, which separate nodes would do side by side.",
    "- **The restart** is the one a job that cannot grow needs to use a new node: stop it, launch it again with one "
    "more replica, resume from the newest checkpoint (`max_failures` would restart the same plan, without the "
    "node). Checkpoints every step, and the kill waits until the last step logged is saved, so the restart redoes "
    "at most the step under way: its best case.",
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2, help="repetitions (each: a grown job and its restart)")
    p.add_argument("--sizes", default="1,2,4", help="the fleet's sizes, grown in this order from the first (1)")
    p.add_argument("--syncs", type=int, default=5, help="syncs timed at each size")
    p.add_argument("--model", default=None, help="a model dir vLLM serves (default: the tiny one, built here)")
    p.add_argument("--quick", action="store_true", help="1 repetition, sizes 1,2, 3 syncs each")
    p.add_argument("--out", default=str(OUT))
    p.add_argument("--json", default=None, help="also write every repetition's numbers here")
    p.add_argument("--retries", type=int, default=1,
                   help="more repetitions allowed when some fail (a failed one is reported, with its reason)")
    p.add_argument("--at-once", action="store_true",
                   help="grow straight to each size (2 -> 4 starts 2 replicas at once) instead of one replica a grow")
    p.add_argument("--keep-logs", default=None, metavar="DIR", help="work in DIR and keep it (the jobs' logs)")
    p.add_argument("--from-json", default=None, help="re-write the report from an earlier --json")
    p.add_argument("--fake", action="store_true", help="synthetic numbers, nothing started (the report's test)")
    args = p.parse_args(argv)
    if args.quick:
        args.reps, args.sizes, args.syncs = 1, "1,2", 3
    sizes = [int(n) for n in args.sizes.split(",")]
    if sizes[0] != 1 or sizes != sorted(set(sizes)) or args.reps < 1 or args.syncs < 1:
        p.error("--sizes must start at 1 and grow (e.g. 1,2,4); --reps and --syncs at least 1")
    given = sys.argv[1:] if argv is None else argv
    shown = [a for i, a in enumerate(given) if not (a.startswith("--out") or i and given[i - 1] == "--out")]
    meta = {"command": " ".join(["bash scripts/in-loopback.sh .venv-vllm/bin/python benchmarks/fleet_growth.py",
                                 *shown]),
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "fake": args.fake, "notes": NOTES,
            "engine_gib": ENGINE_GIB, "load_start": " / ".join(f"{x:.1f}" for x in loadavg()),
            "model": "the tiny model of examples/make_tiny_model.py --vllm" if not args.model else args.model}
    if not args.from_json:
        info = machine()
        meta["machine"] = (f"{info.get('cpus')} cores ({info.get('cpu', '?')}), {info.get('mem_total_gib', '?')} GiB, "
                           f"shared with other jobs; git {info.get('git', '?')}")
        meta["versions"] = versions()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        reps, meta = saved["reps"], {**meta, **saved["meta"], "notes": NOTES}   # the notes: this code's
    elif args.fake:
        reps = fake_reps(args.reps)
    else:
        from benchlib.sandbox import ensure_loopback_only

        ensure_loopback_only(given)
        with tempfile.TemporaryDirectory(prefix="dualrun-fleet-growth-") as tmp:
            work = Path(args.keep_logs or tmp)
            subprocess.run([sys.executable, str(BENCH.parent / "examples" / "make_tiny_model.py"), "--vllm", "--out",
                            str(work / "tiny")], check=True, capture_output=True)
            model = args.model or str(work / "tiny" / "model")
            env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", DUALRUN_JOBS_DIR=str(work / "jobs"))
            reps: list[dict] = []
            i = 0
            while sum(not r.get("failed") for r in reps) < args.reps and i < args.reps + args.retries:
                i += 1
                load = loadavg()[0]
                try:
                    reps.append(one_rep(work / f"rep{i - 1}", model, str(work / "tiny" / "data" / "prompts.jsonl"),
                                        sizes, args.syncs, env, args.at_once))
                except RuntimeError as e:   # a repetition that failed is a finding: said in the report, not hidden
                    print(e, file=sys.stderr, flush=True)
                    reps.append({"load": load, "failed": str(e).splitlines()[0]})
                print(json.dumps(reps[-1]), flush=True)
                if args.json:   # every repetition so far: a cut-short run is still read back (--from-json)
                    Path(args.json).write_text(json.dumps({"meta": meta, "reps": reps}, indent=1))
    if not args.from_json or "load_end" not in meta:   # (a cut-short run's: when it was read back)
        meta["load_end"] = " / ".join(f"{x:.1f}" for x in loadavg())
    text = report(reps, meta)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "reps": reps}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
