"""A failing rank's error file (TORCHELASTIC_ERROR_FILE) is torch's format and is written whole or not at all: the
launcher SIGTERMs the other ranks when one dies and then parses their files, so a half-written one made torchrun's
agent raise JSONDecodeError (seen in CI: a restart test ended "unexpected JSONDecodeError" instead of restarting)."""
from __future__ import annotations

import json

import pytest

from dualrun.rank import bootstrap


def _raise():
    raise RuntimeError("boom on purpose")


def test_the_error_file_is_what_torchs_launcher_parses(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / "attempt_0" / "0" / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    try:
        _raise()
    except RuntimeError as exc:
        bootstrap._record(exc)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message["message"] == "RuntimeError: boom on purpose" and failure.timestamp > 0
    assert "_raise" in json.loads(path.read_text())["message"]["extraInfo"]["py_callstack"]
    assert [p.name for p in path.parent.iterdir()] == ["error.json"]   # no temporary file left beside it


def test_a_rank_killed_while_writing_leaves_no_file_rather_than_a_broken_one(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def killed_mid_write(data, f):
        f.write('{"message": ')
        f.flush()
        raise KeyboardInterrupt   # stands in for the SIGTERM that ends the rank here

    monkeypatch.setattr(json, "dump", killed_mid_write)
    with pytest.raises(KeyboardInterrupt):
        bootstrap._record(RuntimeError("boom"))
    assert not list(tmp_path.iterdir())   # neither error.json nor a half-written temporary file


CUT_OFF = """
import os, sys, time
if os.environ["RANK"] == "1":   # as torch's own @record leaves it when the rank is stopped mid-write
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        f.write('{"message": {"message": "cut off')
    os._exit(1)
time.sleep(120)
"""


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_an_error_file_cut_off_mid_write_ends_the_job_with_one_line(tmp_path):
    """A file dualrun did not write (a script's own `@record`) can still be cut off: torchrun's agent then gives up
    parsing it. The job ends with exit 1 and one line saying so, not "unexpected JSONDecodeError while starting"."""
    from helpers import dualrun

    (tmp_path / "t.py").write_text(CUT_OFF)
    (tmp_path / "cpu2.yaml").write_text("use_cpu: true\nroles: {train: {gpus: 2}}\n")
    proc = dualrun("launch", "--backend", "torchrun", "--config_file", "cpu2.yaml", "t.py", cwd=tmp_path, timeout=100)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("dualrun: error:")]
    assert len(errors) == 1 and "unexpected" not in errors[0], errors
    assert errors[0].startswith("dualrun: error: a train rank failed and torchrun could not read the error file it "
                                "left ("), errors
