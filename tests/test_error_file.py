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
