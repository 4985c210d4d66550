"""Stress: TRL's own `scripts/sft.py` (which ends with `trainer.end()`) N times per backend, 2 CPU processes;
counts hangs (a run past --timeout; its stuck processes are stack-dumped with py-spy when installed) and the
runs where dualrun's exit guard had to step in (its one line names the spot and the stack shows where).

    nice -n 19 bash scripts/in-loopback.sh .venv/bin/python benchmarks/exit_stress.py --runs 100

Writes exit_stress.md (its header: the command, the commit, the versions) and exit_stress.json to --out-dir
(default benchmarks/results); exit code 1 when any run hung or failed.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GUARD = "dualrun: rank"


def sft_script() -> str:
    import trl

    return str(Path(trl.__file__).parent / "scripts" / "sft.py")


def tiny_assets(root: Path) -> Path:
    if not (root / "model" / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_model.py"), "--out", str(root)],
                       check=True, capture_output=True)
    data = root / "sft-dataset"
    if not (data / "train.jsonl").exists():
        data.mkdir(exist_ok=True)
        shutil.copy(root / "data" / "sft.jsonl", data / "train.jsonl")
    return root


def _dump(pgid: int) -> str:
    """py-spy stacks of every process of the stuck run (root needed; skipped when py-spy is missing)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(spy):
        return "(py-spy not installed)"
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
        except OSError:
            continue
        dump = subprocess.run([spy, "dump", "--pid", entry.name], capture_output=True, text=True, timeout=30)
        out.append(f"== pid {entry.name}: {cmd}\n{dump.stdout}{dump.stderr}")
    return "\n".join(out)


def one_run(backend: str, tiny: Path, work: Path, timeout: float, ray_address: str = "") -> dict:
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    ray_tmp = tempfile.mkdtemp(prefix="drx", dir="/tmp")
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", RAY_ADDRESS=ray_address, RAY_TMPDIR=ray_tmp)
    (work / "cpu2.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    cmd = [sys.executable, "-m", "dualrun", "launch", "--backend", backend, "--config_file", "cpu2.yaml", sft_script(), "--model_name_or_path", str(tiny / "model"), "--dataset_name", str(tiny / "sft-dataset"),
           "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "2", "--use_cpu", "true",
           "--report_to", "none", "--logging_steps", "1"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
        hung, stacks = False, ""
    except subprocess.TimeoutExpired:
        hung, stacks = True, _dump(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    saved = (out / "model.safetensors").exists() or any(out.glob("*.safetensors"))
    guard = [ln for ln in text.splitlines() if GUARD in ln and "did not" in ln]
    return {"backend": backend, "exit_code": proc.returncode, "hung": hung, "wall_s": round(time.monotonic() - start, 1),
            "model_saved": saved, "guard_lines": guard, "stacks": stacks,
            "tail": "\n".join(text.splitlines()[-15:]) if (hung or proc.returncode) else ""}


def command() -> str:
    """How this run was started, as far as the process can tell: its niceness, the loopback-only namespace, argv."""
    try:
        with open("/proc/net/dev") as f:
            loopback = {line.split(":")[0].strip() for line in f.readlines()[2:]} <= {"lo"}
    except OSError:
        loopback = False
    niceness = os.nice(0)
    return ((f"nice -n {niceness} " if niceness else "") + ("bash scripts/in-loopback.sh " if loopback else "")
            + "python " + shlex.join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]))


def provenance() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    from importlib import metadata

    versions = ", ".join(f"{d} {metadata.version(d)}" for d in ("torch", "transformers", "trl", "ray"))
    return f"commit {commit.stdout.strip() or '?'}; {versions}"


def write(results: list[dict], out_dir: Path, runs: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "exit_stress.json").write_text(json.dumps(results, indent=1))
    lines = ["# Exit stress: TRL's scripts/sft.py (ends with trainer.end()), 2 CPU processes (gloo)", "",
             f"Command: `{command()}` ({provenance()}).", "",
             f"{runs} run(s) per backend on {os.cpu_count()} core(s); load average {os.getloadavg()[0]:.1f} at the end.",
             "A hang is a run still going after the time limit. 'guard stepped in' counts the runs where a rank's",
             "teardown did not finish in time and dualrun's exit guard ended it with the program's own exit code.", "",
             "| backend | runs | ok | hung | failed | guard stepped in | median wall s |", "|---|---|---|---|---|---|---|"]
    for backend in sorted({r["backend"] for r in results}):
        rs = [r for r in results if r["backend"] == backend]
        walls = sorted(r["wall_s"] for r in rs)
        ok = sum(1 for r in rs if r["exit_code"] == 0 and not r["hung"] and r["model_saved"])
        lines.append(f"| {backend} | {len(rs)} | {ok} | {sum(r['hung'] for r in rs)} | "
                     f"{sum(1 for r in rs if r['exit_code'] and not r['hung'])} | "
                     f"{sum(1 for r in rs if r['guard_lines'])} | {walls[len(walls) // 2]:.1f} |")
    notes = [ln for r in results for ln in r["guard_lines"]]
    if notes:
        lines += ["", "Where the guard stepped in:", ""] + [f"- `{n[:300]}`" for n in notes]
    (out_dir / "exit_stress.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="runs per backend")
    p.add_argument("--backends", default="torchrun,ray")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds after which a run counts as hung")
    p.add_argument("--ray-address", default="", help="a running Ray cluster to join (default: an embedded one per run)")
    p.add_argument("--tiny", type=Path, default=None, help="tiny assets dir (built when missing)")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "results")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dualrun-exit-stress-"))
    tiny = tiny_assets(a.tiny or work / "tiny")
    results = []
    for i in range(a.runs):
        for backend in a.backends.split(","):
            r = one_run(backend, tiny, work, a.timeout, a.ray_address)
            results.append(r)
            status = "HUNG" if r["hung"] else f"exit {r['exit_code']}"
            print(f"run {i + 1}/{a.runs} {backend}: {status} in {r['wall_s']} s"
                  + (f"; guard: {r['guard_lines'][0][:160]}" if r["guard_lines"] else ""), flush=True)
            write(results, a.out_dir, a.runs)
    shutil.rmtree(work, ignore_errors=True)
    bad = [r for r in results if r["hung"] or r["exit_code"] != 0 or not r["model_saved"]]
    for r in bad:
        print(f"--- {r['backend']} run: exit {r['exit_code']}, hung {r['hung']}\n{r['tail']}\n{r['stacks']}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
