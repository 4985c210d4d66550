"""The backend hooks the config asks, whatever the backend: its own config section (`Backend.section_keys`,
`check_section`), checked like the core's sections and carried by the plan, and the machines it finds where the job
is launched (`Backend.machines_found`) for a config without num_machines. A backend of this test's own (`site`, put
into the registry as an entry point's would be) shows a fourth backend gets both; SLURM's use of them is below."""
from __future__ import annotations

from typing import Any, Mapping

import pytest

import dualrun.config.backends as registry
from dualrun.backends.base import Backend
from dualrun.config.backends import BackendKind
from dualrun.config.load import build_config
from dualrun.config.schema import Key
from dualrun.contract.errors import ConfigError
from dualrun.plan.meeting import rendezvous_of
from dualrun.plan.placement import MachinesPlacement


class SiteBackend(Backend):
    kind = BackendKind("site", per_machine=True, ray=False, groups="local", placement=MachinesPlacement)
    output = "here"
    section = "site"
    section_keys = (Key("queue", "str", "short", "the site's queue", backends="site"),
                    Key("slots", "int", 1, "slots", backends="site", minimum=1, maximum=8))

    def check_section(self, source: str, values: Mapping[str, Any]) -> None:
        if values["queue"] == "forbidden":
            raise ConfigError(source, "site.queue", "a queue of the site", values["queue"])

    def machines_found(self, environ: Mapping[str, str]) -> tuple[int, str] | None:
        n = environ.get("SITE_NODES")
        return (int(n), f"the site's {n} nodes") if n else None

    def launcher_class(self) -> Any:
        raise NotImplementedError

    def check(self, cfg: Any, wait_s: float | None = None) -> Any:
        return [], [], []


@pytest.fixture
def site(monkeypatch):
    monkeypatch.setattr(registry, "_registered", lambda: {"site": SiteBackend()})


def load(text: dict, backend: str, environ: Mapping[str, str] | None = None):
    return build_config({"use_cpu": True, **text}, "c.yaml", backend=backend, environ=environ or {})


def test_a_backends_own_section_is_checked_and_carried_by_the_plan(site):
    cfg = load({"site": {"queue": "long"}}, "site")
    assert dict(cfg.sections["site"]) == {"queue": "long", "slots": 1}
    assert dict(rendezvous_of(cfg).options) == {"queue": "long", "slots": 1}
    assert dict(load({}, "site").sections["site"]) == {"queue": "short", "slots": 1}   # absent: its defaults
    for section, line in (({"queu": "x"}, "c.yaml: site.queu: expected a known `site` key, got an unknown key "
                           "(did you mean 'queue'?)"),
                          ({"slots": 9}, "c.yaml: site.slots: expected an integer <= 8, got 9"),
                          ({"queue": "forbidden"}, "c.yaml: site.queue: expected a queue of the site, got forbidden"),
                          ([1], "c.yaml: site: expected a mapping of `site` keys, got [1]")):
        with pytest.raises(ConfigError) as e:
            load({"site": section}, "site")
        assert str(e.value) == line
    # another backend's job: the section is still checked (one file serves every backend), and not carried
    assert "site" in load({"site": {"queue": "long"}}, "torchrun").sections
    assert rendezvous_of(load({"site": {"queue": "long"}}, "torchrun")).options.__class__.__name__ == "TorchrunOptions"
    with pytest.raises(ConfigError, match="site.slots: expected an integer >= 1"):
        load({"site": {"slots": 0}}, "torchrun")


def test_an_unowned_section_is_still_an_unknown_key(site):
    with pytest.raises(ConfigError) as e:
        load({"sit": {}}, "site")
    assert "sit: expected a known key (accelerate's or dualrun's), got an unknown key" in str(e.value)


def test_an_unset_num_machines_is_what_the_backend_finds(site):
    cfg = load({"roles": {"train": {"gpus": 4}}}, "site", {"SITE_NODES": "2"})
    assert cfg.num_machines == 2 and cfg.machines_from == "the site's 2 nodes" and "num_machines" not in cfg.written
    assert load({"num_machines": 1}, "site", {"SITE_NODES": "2"}).num_machines == 1   # a set one stays
    assert load({}, "site").num_machines == 1 and load({}, "site").machines_from is None
    assert load({}, "torchrun", {"SITE_NODES": "2"}).num_machines == 1   # only the job's backend is asked
    with pytest.raises(ConfigError) as e:
        load({"roles": {"train": {"gpus": 3}}}, "site", {"SITE_NODES": "2"})
    assert str(e.value) == ("c.yaml: num_processes: expected a multiple of num_machines=2, got 3 (num_machines "
                            "unset: the site's 2 nodes)")
