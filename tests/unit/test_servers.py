"""Server lifecycle and the CPU engine, with real processes and real HTTP on 127.0.0.1 (no torchrun, no Ray)."""
from __future__ import annotations

import os
import sys
import threading
import time
from http.server import ThreadingHTTPServer

import pytest

from dualrun.servers.process import ServerError, ServerProcess, http_ok
from helpers import free_port, gone

pytestmark = pytest.mark.timeout(120)

# A stand-in server: healthy after DELAY s; with CHILD it also starts a grandchild (must die with the group).
STANDIN = r"""
import os, sys, time, subprocess
from http.server import BaseHTTPRequestHandler, HTTPServer
port, delay = int(sys.argv[1]), float(sys.argv[2])
print("stand-in starting", flush=True)
if os.environ.get("CHILD"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"child pid {child.pid}", flush=True)
if os.environ.get("SLOW_CHILD"):   # like vLLM's engine processes: ignore SIGTERM, hold much memory
    for _ in range(4):
        child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                  "signal.SIG_IGN); block = b'x' * (192 << 20); print('ready', flush=True); "
                                  "time.sleep(600)"], stdout=subprocess.PIPE)
        child.stdout.readline()
        print(f"child pid {child.pid}", flush=True)
if os.environ.get("CRASH"):
    raise SystemExit("stand-in: cannot load the model")
time.sleep(delay)
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *a): pass
HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _standin(tmp_path, delay=0.0, timeout=20.0, **env) -> ServerProcess:
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    port = free_port()
    full = dict(os.environ, **env)
    return ServerProcess("teacher server 0", [sys.executable, str(script), str(port), str(delay)], full,
                         "127.0.0.1", port, "/health", timeout, str(tmp_path / "s.log"), stream=None)


def test_start_healthy_stop_kills_the_group(tmp_path):
    server = _standin(tmp_path, delay=0.5, CHILD="1").start()
    server.wait_healthy()
    assert http_ok(server.health_url) and server.alive()
    child = int(next(ln for ln in server.tail().splitlines() if ln.startswith("child pid")).split()[-1])
    pid = server.proc.pid
    server.stop(grace_s=5)
    assert gone(pid) and gone(child), "the server and its helpers must all be gone"
    assert not http_ok(server.health_url)
    assert "stand-in starting" in (tmp_path / "s.log").read_text()
    server.stop()  # idempotent


def test_stop_returns_only_when_the_whole_group_is_gone(tmp_path):
    """Helpers that ignore SIGTERM and hold memory (as vLLM's engine processes do) are still tearing down when the
    server itself has been reaped: `stop` waits for every process of the group, not only the leader."""
    server = _standin(tmp_path, SLOW_CHILD="1").start()
    server.wait_healthy()
    children = [int(ln.split()[-1]) for ln in server.tail().splitlines() if ln.startswith("child pid")]
    server.stop(grace_s=0.5)
    assert len(children) == 4 and all(gone(c) for c in children), "a helper of the server outlived stop()"


def test_never_healthy_fails_within_timeout_with_log_tail(tmp_path):
    server = _standin(tmp_path, delay=60, timeout=1.5).start()
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        server.wait_healthy()
    assert time.monotonic() - t0 < 5
    text = str(e.value)
    assert "did not become healthy within 1.5 s" in text and "stand-in starting" in text and "s.log" in text
    server.stop()
    assert gone(server.proc.pid)


def test_exit_before_healthy_is_reported_at_once(tmp_path):
    server = _standin(tmp_path, delay=60, timeout=60, CRASH="1").start()
    t0 = time.monotonic()
    with pytest.raises(ServerError) as e:
        server.wait_healthy()
    assert time.monotonic() - t0 < 10
    assert "exited with code 1" in str(e.value) and "cannot load the model" in str(e.value)
    assert "cannot load the model" in e.value.one_line()


def test_a_server_that_dies_is_named_with_its_code_and_log(tmp_path):
    """What the watchers of both backends report: label, exit code (and signal), the log's last lines."""
    import signal

    server = _standin(tmp_path).start()
    try:
        server.wait_healthy()
        os.kill(server.proc.pid, signal.SIGKILL)
        err = server.wait_exit()
    finally:
        server.stop()
    assert str(err).startswith("teacher server 0 exited with code -9 (killed by SIGKILL) while the job was running")
    assert "--- last lines of its log ---" in str(err) and "stand-in starting" in str(err)
    assert err.one_line().endswith(": stand-in starting")


def test_free_port_never_returns_an_avoided_port():
    from dualrun.light.ports import free_port

    taken = {free_port() for _ in range(5)}
    assert all(free_port(avoid=taken) not in taken for _ in range(20))


def test_missing_command_is_a_server_error(tmp_path):
    server = ServerProcess("rollout server 0", ["/nonexistent/vllm"], {}, "127.0.0.1", free_port())
    with pytest.raises(ServerError, match="could not start"):
        server.start()


# -- the CPU engine ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny):
    from dualrun.programs.cpu_engine import Engine, make_handler

    eng = Engine(str(tiny / "teacher"))
    srv = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(eng))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield eng, f"127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_engine_scores_top_k_like_the_model(engine, tiny):
    """TRL's own client asks for prompt logprobs; the answer is the teacher's real top-k."""
    import torch
    from transformers import AutoModelForCausalLM

    from dualrun.rank.teacher import teacher_client

    _, address = engine
    client = teacher_client(f"http://{address}")
    seq = [1, 5, 9, 12, 7, 30]
    got = client.get_sequence_logprobs([seq], [2], top_logprobs=3, temperature=1.0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny / "teacher")).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([seq])).logits[0], -1)
    for j, pos in enumerate(range(2, len(seq))):
        values, ids = torch.topk(ref[pos - 1], 3)
        assert got["logprob_token_ids"][0][j] == ids.tolist()
        assert got["logprobs"][0][j] == pytest.approx(values.tolist(), abs=1e-5)
        assert got["actual_logprobs"][0][j][0] == pytest.approx(ref[pos - 1, seq[pos]].item(), abs=1e-5)


def test_engine_generates_and_reports_models(engine):
    from dualrun.rank.teacher import teacher_client

    eng, address = engine
    client = teacher_client(f"http://{address}")
    assert client.model == eng.name
    out = client.generate([[1, 5, 9], "what is 1 plus 2 ?"], n=2, max_tokens=4, logprobs=2,
                          generation_kwargs={"seed": 3})
    assert len(out["prompt_ids"]) == 2 and out["prompt_ids"][0] == [1, 5, 9] and len(out["completion_ids"]) == 4
    assert all(1 <= len(c) <= 4 for c in out["completion_ids"])
    assert all(len(step) >= 2 for seq in out["logprob_token_ids"] for step in seq)
    assert http_ok(f"http://{address}/health") and http_ok(f"http://{address}/get_world_size")


def test_engine_greedy_with_several_completions_answers_copies(engine):
    """GRPO asks for `num_generations` completions per prompt; greedy, they are all the one greedy completion (as vLLM
    answers; transformers' generate refuses num_return_sequences > 1 without sampling)."""
    from dualrun.rank.teacher import teacher_client

    _, address = engine
    client = teacher_client(f"http://{address}")
    out = client.generate([[1, 5, 9], [2, 4]], n=3, max_tokens=4, temperature=0.0, logprobs=0)
    one = client.generate([[1, 5, 9], [2, 4]], n=1, max_tokens=4, temperature=0.0, logprobs=0)
    assert out["completion_ids"] == [c for c in one["completion_ids"] for _ in range(3)]
    assert out["logprobs"] == [lp for lp in one["logprobs"] for _ in range(3)]


def test_engine_answers_each_prompt_as_if_it_came_alone(engine):
    """A router splits a request over however many replicas are in rotation: the CPU engine's answer to a prompt
    (scoring and seeded sampling) must not depend on the prompts that came with it, bit for bit."""
    eng, _ = engine
    seqs = [[1, 5, 9, 12, 7, 30, 4, 8, 11, 2, 6], [2, 4], [1, 8, 8, 2, 6, 9, 40], [3, 33, 5, 7, 9, 12, 14, 16, 18,
                                                                                    20, 22, 24, 26, 28, 30]]
    together = eng.prompt_logprobs(seqs, 5, 1.0)
    assert together == [eng.prompt_logprobs([s], 5, 1.0)[0] for s in seqs]
    assert together == eng.prompt_logprobs(seqs[:1], 5, 1.0) + eng.prompt_logprobs(seqs[1:], 5, 1.0)
    body = {"prompt": seqs, "n": 2, "max_tokens": 6, "temperature": 1.0, "logprobs": 1, "seed": 5,
            "return_tokens_as_token_ids": True}
    whole = [(c["token_ids"], c["logprobs"]) for c in eng.completions(body)["choices"]]
    alone = [(c["token_ids"], c["logprobs"]) for s in seqs for c in eng.completions({**body, "prompt": [s]})["choices"]]
    assert whole == alone


def test_engine_stats_count_what_it_served(engine):
    """`GET /engine/stats`: what the router tests and the replica benchmark read to see every replica got work."""
    import json
    import urllib.request

    from dualrun.programs.cpu_engine import STATS_PATH
    from dualrun.rank.teacher import teacher_client

    _, address = engine

    def stats() -> dict:
        with urllib.request.urlopen(f"http://{address}{STATS_PATH}", timeout=10) as r:
            return json.loads(r.read())

    before = stats()
    teacher_client(f"http://{address}").generate([[1, 5, 9], [2, 4]], n=1, max_tokens=3)
    after = stats()
    assert after["completions"] == before["completions"] + 1 and after["prompts"] == before["prompts"] + 2
    assert after["completion_tokens"] > before["completion_tokens"]


def test_remote_teacher_equals_the_local_teacher_cut_to_top_k(engine, tiny):
    """Left padding, a masked row tail, several rows: each position gets the teacher's top-k plus the tail."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dualrun.rank.teacher import RemoteTeacher, truncate_logits

    _, address = engine
    teacher = RemoteTeacher(address, 4, AutoConfig.from_pretrained(str(tiny / "teacher")))
    ids = torch.tensor([[1, 5, 9, 12, 7, 30], [0, 0, 1, 8, 8, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]])
    got = torch.log_softmax(teacher(input_ids=ids, attention_mask=mask).logits, -1)
    model = AutoModelForCausalLM.from_pretrained(str(tiny / "teacher")).eval()
    for row, (start, end) in enumerate([(0, 5), (2, 6)]):
        with torch.no_grad():
            ref = torch.log_softmax(truncate_logits(model(ids[row:row + 1, start:end]).logits, 4), -1)[0]
        assert torch.allclose(got[row, start:end - 1], ref[:-1], atol=1e-4)


def test_topk_to_logits_keeps_top_k_and_tail_mass():
    import torch

    from dualrun.rank.teacher import topk_to_logits

    lps = torch.log(torch.tensor([[0.5, 0.2, float("nan")]])).nan_to_num(nan=float("-inf"))
    ids = torch.tensor([[3, 0, 0]])
    probs = torch.softmax(topk_to_logits(lps, ids, 6), -1)[0]
    assert probs[3].item() == pytest.approx(0.5) and probs[0].item() == pytest.approx(0.2)
    assert probs[[1, 2, 4, 5]].tolist() == pytest.approx([0.075] * 4)
    with pytest.raises(ValueError, match="share a tokenizer"):
        topk_to_logits(lps, torch.tensor([[9, 0, 0]]), 6)
