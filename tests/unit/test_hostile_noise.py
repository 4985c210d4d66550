"""Hostile traffic makes one line per kind of trouble, not a traceback per request (dualrun/light/noise.py): a real
misbehaving client (tests/support/assets/hostile_client.py) against a real CPU engine and a real router on loopback;
both still serve afterwards."""
from __future__ import annotations

import io
import json
import re
import sys
import urllib.request

import pytest

from dualrun.light.noise import DROPPED, MALFORMED, Noise
from dualrun.servers.process import ServerProcess
from dualrun.plan.server_commands import router_argv
from helpers import ASSETS, free_port

sys.path.insert(0, str(ASSETS))
from hostile_client import attack  # noqa: E402

ATTACKS = 20   # connections of each kind, against each server


def test_each_kind_is_one_line_then_a_count_at_most_once_per_interval():
    now = [0.0]
    out = io.StringIO()
    noise = Noise("dualrun engine", every_s=60, stream=out, clock=lambda: now[0])
    for _ in range(50):
        noise.report(DROPPED, BrokenPipeError(32, "Broken pipe"), "from 10.0.0.7")
        now[0] += 0.5                                  # 50 in 25 s: the first said, the rest counted
    noise.report(MALFORMED, "HTTP 400", "bad request line \x1b[31m\nforged")
    now[0] = 61.0
    noise.report(DROPPED, BrokenPipeError(32, "Broken pipe"), "from 10.0.0.8")
    lines = out.getvalue().splitlines()
    assert lines == [
        "dualrun engine: a dropped connection (BrokenPipeError: [Errno 32] Broken pipe: from 10.0.0.7); more of this "
        "kind are counted and reported at most once per 60 s",
        "dualrun engine: a malformed request (HTTP 400: bad request line \\x1b[31m forged); more of this kind are "
        "counted and reported at most once per 60 s",
        "dualrun engine: a dropped connection (BrokenPipeError): 50 more in the last 61 s; the latest: [Errno 32] "
        "Broken pipe: from 10.0.0.8"]


def _trouble_lines(text: str, prefix: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in re.finditer(rf"^{prefix}: (a [a-z ]+?) \((\w[\w ]*?)[:)]", text, re.M)]


def _complete(port: int) -> dict:
    body = json.dumps({"prompt": [[1, 2, 3]], "max_tokens": 2, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=60) as answer:
        assert answer.status == 200
        return json.loads(answer.read())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hostile_client_gets_one_line_per_kind_from_the_router_and_the_engine(tmp_path, tiny):
    engine_port, router_port = free_port(), free_port()
    engine_out, router_out = io.StringIO(), io.StringIO()
    engine = ServerProcess("teacher server 0", [sys.executable, "-m", "dualrun.programs.cpu_engine",
                                                "--model", str(tiny / "model"), "--port", str(engine_port)],
                           {}, "127.0.0.1", engine_port, "/health", 180, str(tmp_path / "engine.log"),
                           stream=engine_out)
    router = ServerProcess("teacher router", router_argv("127.0.0.1", router_port, [f"127.0.0.1:{engine_port}"]),
                           {}, "127.0.0.1", router_port, "/health", 60, str(tmp_path / "router.log"),
                           stream=router_out)
    try:
        engine.start().wait_healthy()
        router.start().wait_healthy()
        for port in (router_port, engine_port):
            sent = attack("127.0.0.1", port, ATTACKS)
            assert all(count == ATTACKS for count in sent.values()), sent
        assert _complete(router_port)["choices"] and _complete(engine_port)["choices"]   # both still serve
    finally:
        router.stop(5)
        engine.stop(5)
    for text, prefix in ((engine_out.getvalue(), r"\[teacher server 0\] dualrun engine"),
                         (router_out.getvalue(), r"\[teacher router\] dualrun router")):
        assert "Traceback" not in text, text[-3000:]
        kinds = _trouble_lines(text, prefix)
        assert kinds and len(kinds) == len(set(kinds)), text     # each kind once
        assert {what for what, _ in kinds} == {MALFORMED, "a dropped connection"}, kinds
        assert len(text.splitlines()) < 15, text
