"""The names users write: every public name of `dualrun` resolves, and `dualrun.roles` (the role-program package's
old name, before `roles` meant only the config's `roles:` section) still gives the same objects."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import dualrun
import dualrun.role_programs as programs


def test_every_public_name_resolves():
    assert {"worker", "function", "get_runtime", "DISPATCH", "COLLECT"} <= set(dualrun.__all__)
    missing = [name for name in dualrun.__all__ if getattr(dualrun, name, None) is None]
    assert missing == []
    assert [name for name in programs.__all__ if getattr(programs, name, None) is None] == []


def test_the_old_name_gives_the_same_objects():
    import dualrun.roles as old

    assert "old name of `dualrun.role_programs`" in (old.__doc__ or "")
    assert {name: getattr(old, name) is getattr(programs, name) for name in programs.__all__} == \
        {name: True for name in programs.__all__}
    assert dualrun.roles.DISPATCH is dualrun.DISPATCH is programs.DISPATCH
    assert dualrun.roles.get_runtime is dualrun.get_runtime
    from dualrun.roles import COLLECT, worker
    assert (COLLECT, worker) == (dualrun.COLLECT, dualrun.worker)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        old.nothing_here  # noqa: B018


def test_the_old_name_loads_no_second_copy_of_a_submodule():
    """A second `runtime` module would hold a runtime of its own: the old name is no package, and says so."""
    with pytest.raises(ModuleNotFoundError, match="'dualrun.roles' is not a package"):
        importlib.import_module("dualrun.roles.runtime")
    with pytest.raises(AttributeError):
        dualrun.roles.__path__  # noqa: B018


def test_a_fresh_interpreter_reads_the_old_name_after_import_dualrun_alone():
    """examples/sampling.py's old spelling, `import dualrun` then `dualrun.roles.get_runtime()`, and `import *`."""
    probe = ("import sys, dualrun\n"
             "assert 'dualrun.role_programs.runtime' not in sys.modules\n"
             "assert dualrun.roles.get_runtime is dualrun.role_programs.runtime.get_runtime\n"
             "ns = {}\nexec('from dualrun.roles import *', ns)\n"
             "assert ns['DISPATCH'] is dualrun.DISPATCH and ns['worker'] is dualrun.worker\n"
             "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout.strip()) == (0, "ok"), r.stderr[-2000:]
