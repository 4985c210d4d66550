"""Progress bars through the Ray backend's pipe: real tqdm output collapsed into a few readable lines."""
from __future__ import annotations

import io

import pytest

from dualrun.light.progress import Collapser, looks_like_bar, show_progress

tqdm = pytest.importorskip("tqdm").tqdm


def _bar_text(steps: int = 8, log_every: int = 0) -> str:
    """What an 8-step tqdm bar (with tqdm.write log lines, like Trainer's) writes into a pipe."""
    f = io.StringIO()
    bar = tqdm(total=steps, file=f, mininterval=0, miniters=1, ncols=60)
    for i in range(steps):
        bar.update(1)
        if log_every and (i + 1) % log_every == 0:
            bar.write(f"{{'loss': {i}.0}}", file=f)
    bar.close()
    f.write("done\n")
    return f.getvalue()


def _collapse(text: str, chunk: int = 7, **kw) -> tuple[list[str], list[str]]:
    c, raw, out = Collapser(**kw), [], []
    for i in range(0, len(text), chunk):       # arbitrary chunk borders, as a pipe delivers them
        out += c.feed(text[i:i + chunk], raw.append)
    return out + c.close(raw.append), raw


def test_an_eight_step_bar_becomes_two_lines_and_the_log_keeps_every_redraw():
    text = _bar_text()
    assert text.count("\r") >= 8        # tqdm really redrew it per step
    out, raw = _collapse(text)
    bars = [ln for ln in out if looks_like_bar(ln)]
    assert len(bars) == 2, out          # the first draw and the final state
    assert "8/8" in bars[-1] and "0/8" in bars[0]
    assert out[-1] == "done"
    assert sum(looks_like_bar(r) for r in raw) >= 9   # log_dir gets everything


def test_log_lines_between_redraws_all_survive():
    out, _ = _collapse(_bar_text(log_every=1))
    assert [ln for ln in out if ln.startswith("{'loss'")] == [f"{{'loss': {i}.0}}" for i in range(8)]
    assert sum(looks_like_bar(ln) for ln in out) <= 2


def test_other_ranks_drop_bars_but_keep_lines():
    out, raw = _collapse(_bar_text(log_every=4), show_bars=False)
    assert not any(looks_like_bar(ln) for ln in out)
    assert out == ["{'loss': 3.0}", "{'loss': 7.0}", "done"]
    assert any("8/8" in r for r in raw)


def test_a_long_bar_shows_life_every_interval():
    now = [0.0]
    c = Collapser(interval_s=10, clock=lambda: now[0])
    shown = []
    for step in range(100):
        now[0] = step * 1.0
        shown += c.feed(f"\r{step}%|#| {step}/100 [00:0{step % 10}<00:00]")
    assert len(shown) == 10 and shown[0].startswith("0%")
    assert c.close() == ["99%|#| 99/100 [00:09<00:00]"]


def test_plain_lines_and_crlf_pass_unchanged():
    out, _ = _collapse("a\r\nb\n\nc")
    assert out == ["a", "b", "", "c"]


@pytest.mark.parametrize("mode,rank,shown", [("rank0", "0", True), ("rank0", "1", False), ("all", "3", True),
                                             ("none", "0", False), ("bogus", "1", False), ("rank0", None, True)])
def test_which_ranks_show_bars(mode, rank, shown):
    assert show_progress(mode, rank) is shown
