"""`dualrun config`: the questions (pure, in milliseconds) and the real CLI answered through a pseudo-terminal,
its file then shown by `dualrun plan`."""
from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, dualrun

from dualrun.cli import _plan_checked
from dualrun.config.asking import converse
from dualrun.config.questions import Invalid, blamed_question, config_of, next_question, yaml_text
from dualrun.config.yamlfile import parse
from dualrun.contract.errors import ConfigError
from dualrun.methods.question_context import question_context

CPU = question_context(devices=0, dist="NO")
GPUS = question_context(devices=4, dist="MULTI_GPU")


def answered(ctx, typed):
    """The answers after typing `typed` (a line each, "" for Enter); asserts every line was asked for."""
    answers: dict[str, str] = {}
    for line in typed:
        q = next_question(ctx, answers)
        assert q is not None, f"no question left for {line!r}: {answers}"
        answers[q.key] = line
    return answers


def conversation(ctx, typed):
    """converse() with `typed` as the keyboard: (the file's content, every prompt and line it showed)."""
    shown, lines = [], iter(typed)

    def read(prompt):
        shown.append(prompt)
        return next(lines)

    raw = converse(ctx, read, shown.append, lambda raw: _plan_checked("F.yaml", yaml_text(raw, "F.yaml")))
    return raw, shown


# ---- the pure part ---------------------------------------------------------------------------------------------

def test_enter_takes_every_default_a_cpu_machine_gets_a_cpu_sft_config():
    answers = answered(CPU, [""] * 6)
    assert next_question(CPU, answers) is None
    assert config_of(CPU, answers) == {
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "mixed_precision": "no",
        "use_cpu": True, "num_machines": 1, "backend": "torchrun", "method": "sft", "roles": {"train": {"gpus": 2}}}


def test_defaults_in_brackets_follow_the_machine_and_the_earlier_answers():
    q = next_question(GPUS, answered(GPUS, ["", ""]))
    assert q.key == "use_cpu" and q.prompt().endswith("[no]: ")
    q = next_question(GPUS, answered(GPUS, ["", "2", "10.0.0.1", "", ""]))
    assert q.key == "machine_gpus" and q.prompt().endswith("[4]: ")
    grpo = answered(GPUS, ["", "", "", "", "", "grpo", "separate", "3"])
    assert next_question(GPUS, grpo).prompt().endswith("(vllm, transformers) [vllm]: ")


def test_an_invalid_answer_says_what_is_expected():
    q = next_question(CPU, {})
    with pytest.raises(Invalid) as e:
        q.value("mpi")
    assert q.complaint("mpi", e.value) == "backend: expected one of torchrun, ray, slurm, got mpi"
    q = next_question(CPU, answered(CPU, [""]))
    with pytest.raises(Invalid, match="an integer from 1 to 16384"):
        q.value("0")


def test_a_separate_role_takes_gpus_from_the_trainers_and_tensor_parallel_divides_them():
    answers = answered(GPUS, ["", "", "", "8", "", "grpo", "separate", "4", "", "2", "Qwen/Qwen2.5-0.5B", ""])
    raw = config_of(GPUS, answers)
    assert raw["roles"] == {"train": {"gpus": 4}, "rollout": {"gpus": 4, "engine": "vllm", "tensor_parallel_size": 2,
                                                             "model": "Qwen/Qwen2.5-0.5B"}}
    tp = next_question(GPUS, answered(GPUS, ["", "", "", "8", "", "grpo", "separate", "4", ""]))
    with pytest.raises(Invalid, match="divides 4"):
        tp.value("3")
    trainers = next_question(GPUS, {k: v for k, v in answers.items() if k != "roles.train.gpus"})
    with pytest.raises(Invalid, match="from 1 to 4"):
        trainers.value("5")


def test_an_answer_a_changed_earlier_answer_made_invalid_is_asked_again():
    answers = answered(GPUS, ["", "", "", "8", "", "grpo", "separate", "6", "", "1", "m", ""])
    assert next_question(GPUS, answers) is None
    answers["machine_gpus"] = "4"            # 6 of 4 GPUs: no longer an answer
    assert next_question(GPUS, answers).key == "roles.rollout.gpus"


def test_a_colocated_role_shares_the_trainers_gpus():
    answers = answered(GPUS, ["", "", "", "", "", "gkd", "colocated", "Qwen/Qwen2.5-1.5B", "", "none", ""])
    raw = config_of(GPUS, answers)
    assert raw["roles"] == {"train": {"gpus": 4}, "teacher": {"gpus": 4, "model": "Qwen/Qwen2.5-1.5B"}}
    assert raw["colocate_groups"] == [["train", "teacher"]]


def test_several_torchrun_machines_ask_machine_0s_address_ray_does_not():
    raw = config_of(GPUS, answered(GPUS, ["", "2", "10.0.0.1", "", "", "", "", "", ""]))
    assert (raw["main_process_ip"], raw["main_process_port"], raw["torchrun"]) == \
        ("10.0.0.1", 29500, {"gpus_per_machine": 4})
    assert raw["roles"]["train"]["gpus"] == 8
    raw = config_of(GPUS, answered(GPUS, ["ray", "2", "", "", "", "", ""]))
    assert "main_process_ip" not in raw and "torchrun" not in raw and raw["roles"]["train"]["gpus"] == 8


def test_a_loader_error_asks_the_question_of_its_key_again():
    answers = answered(GPUS, ["", "2", "10.0.0.1", "", "", "", "", "gkd", "separate", "1", "", "m", "", "none", ""])
    assert blamed_question(GPUS, answers, "torchrun.gpus_per_machine").key == "machine_gpus"
    assert blamed_question(GPUS, answers, "roles.teacher.engine").key == "roles.teacher.engine"
    assert blamed_question(GPUS, answers, "colocate_groups").key == "roles.teacher"
    assert blamed_question(GPUS, answers, "roles.teacher.server_args").key == "roles.teacher"
    assert blamed_question(GPUS, answers, "ray.address") is None


def test_a_file_the_loader_refuses_is_never_returned_the_blamed_question_is_asked_again():
    """On CPU without vLLM's CPU build, a separate teacher on vllm is refused by dualrun's own loader: its engine
    question is asked again with the loader's line, and the answer taken then is what the file holds."""
    pytest.importorskip("yaml")
    try:
        import vllm  # noqa: F401
        pytest.skip("vLLM is installed: a CPU teacher on vllm is a valid file here")
    except ImportError:
        pass
    raw, shown = conversation(CPU, ["", "", "", "", "gkd", "separate", "1", "vllm", "m", "5", "none", "",
                                    "transformers"])
    assert raw["roles"]["teacher"]["engine"] == "transformers"
    refusal = [s for s in shown if "roles.teacher.engine: expected `transformers`" in s]
    assert refusal and shown[shown.index(refusal[0]) + 1].startswith("Which engine runs the `teacher` role?")


@pytest.mark.parametrize("ctx", [CPU, GPUS], ids=["cpu", "gpus"])
@pytest.mark.parametrize("method,layouts", [("sft", []), ("pt", []), ("grpo", ["colocated"]), ("grpo", ["separate"]),
                                            ("gkd", ["colocated", "none"]), ("gkd", ["separate", "none"]),
                                            ("gkd", ["none", "separate"])])
def test_every_layout_answered_with_the_defaults_is_a_file_dualrun_plan_takes(ctx, method, layouts):
    """Whatever the layout, Enter everywhere else (a model where one is needed) gives a file `dualrun plan` takes:
    the loader's verdict, through the file's own text."""
    answers: dict[str, str] = {"machine_gpus": "4", "method": method}
    answers.update({f"roles.{role}": layout for role, layout in
                    zip([r for r in ctx.methods[method].roles[1:]], layouts)})
    while (q := next_question(ctx, answers)) is not None:
        answers[q.key] = "m" if q.key.endswith(".model") and q.default is None else ""
        if q.key.endswith(".engine") and ctx is CPU:
            answers[q.key] = ctx.engine_on_cpus     # vLLM's CPU build is not installed here
    raw = config_of(ctx, answers)
    text = yaml_text(raw, "F.yaml")
    assert parse("F.yaml", text) == raw
    _plan_checked("F.yaml", text)


# ---- the real CLI on a pseudo-terminal ---------------------------------------------------------------------------

class Terminal:
    """`dualrun config ARGS` with a pseudo-terminal as its stdin, stdout and stderr: what a user types and reads."""

    def __init__(self, cwd: Path, *args: str) -> None:
        self.master, slave = os.openpty()
        env = {**os.environ, "PYTHONPATH": str(REPO), "TERM": "dumb"}
        self.proc = subprocess.Popen([sys.executable, "-m", "dualrun", "config", *args], cwd=cwd, stdin=slave,
                                     stdout=slave, stderr=slave, env=env, close_fds=True, start_new_session=True)
        os.close(slave)
        self.seen = ""

    def expect(self, text: str, timeout: float = 120) -> str:
        """Wait until `text` is on the screen after what was matched before; what came up to and with it."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"waited {timeout} s for {text!r}; the screen: {self.seen[-2000:]!r}"
            if select.select([self.master], [], [], min(left, 1))[0]:
                try:
                    chunk = os.read(self.master, 4096).decode(errors="replace")
                except OSError:   # the other end closed: the command ended
                    chunk = ""
                if not chunk and self.proc.poll() is not None:
                    assert text in self.seen, f"ended without {text!r}; the screen: {self.seen[-2000:]!r}"
                self.seen += chunk.replace("\r\n", "\n")
        head, _, self.seen = self.seen.partition(text)
        return head + text

    def answer(self, prompt: str, typed: str) -> None:
        self.expect(prompt)
        os.write(self.master, typed.encode() + b"\n")

    def ends(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        os.close(self.master)
        return code


def _talk(term: Terminal, dialogue: list[tuple[str, str]]) -> None:
    for prompt, typed in dialogue:
        term.answer(prompt, typed)


def _plan(path: Path) -> str:
    proc = dualrun("plan", "--config_file", str(path), cwd=path.parent)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


START = [("Which backend runs the job? (torchrun, ray, slurm) [torchrun]: ", ""),
         ("How many different machines will you use (use more than 1 for multi-node training)? [1]: ", ""),
         ("Do you want to run your training on CPU only (no GPUs)? (yes, no) ", "no")]


def test_sft_answered_on_a_terminal_writes_the_file_dualrun_plan_shows(tmp_path):
    term = Terminal(tmp_path, "--config_file", "sft.yaml")
    _talk(term, START + [("How many GPUs does each machine give the job? ", "2"),
                         ("Do you wish to use mixed precision? (no, fp16, bf16) [bf16]: ", ""),
                         ("Which method does the script train with? (sft, pt, grpo, gkd) [sft]: ", ""),
                         ("How many GPUs do the trainers take (roles.train.gpus)? [2]: ", "")])
    term.expect("wrote sft.yaml")
    assert term.ends() == 0
    plan = _plan(tmp_path / "sft.yaml")
    assert "method=sft" in plan and "GPU 1        train rank 1  (world 2, local_rank 1)" in plan


def test_grpo_with_a_separate_vllm_rollout(tmp_path):
    term = Terminal(tmp_path, "--config-file", "grpo.yaml")
    _talk(term, START + [("How many GPUs does each machine give the job? ", "6"),
                         ("mixed precision? (no, fp16, bf16) [bf16]: ", "bf16"),
                         ("[sft]: ", "grpo"),
                         ("Does the job have a `rollout` role", "separate"),
                         ("How many GPUs does the `rollout` server take? [1]: ", "2"),
                         ("Which engine runs the `rollout` role? (vllm, transformers) [vllm]: ", ""),
                         ("(tensor_parallel_size; the rest are more replicas)? [1]: ", "2"),
                         ("A path or hub name: ", "Qwen/Qwen2.5-0.5B-Instruct"),
                         ("(roles.train.gpus)? [4]: ", "")])
    term.expect("wrote grpo.yaml")
    assert term.ends() == 0
    plan = _plan(tmp_path / "grpo.yaml")
    assert "method=grpo" in plan and "GPU 3        train rank 3  (world 4, local_rank 3)" in plan
    assert "GPU 4,5      rollout server 0" in plan


def test_gkd_with_a_separate_teacher_and_an_invalid_answer_asked_again(tmp_path):
    term = Terminal(tmp_path)
    _talk(term, START + [("How many GPUs does each machine give the job? ", "many")])
    term.expect("machine_gpus: expected an integer from 1 to 1024, got many")
    _talk(term, [("How many GPUs does each machine give the job? ", "4"),
                 ("mixed precision? (no, fp16, bf16) [bf16]: ", ""),
                 ("[sft]: ", "gkd"),
                 ("Does the job have a `teacher` role", "separate"),
                 ("How many GPUs does the `teacher` server take? [1]: ", "1"),
                 ("Which engine runs the `teacher` role? (vllm, transformers) [vllm]: ", ""),
                 ("A path or hub name: ", "Qwen/Qwen2.5-7B-Instruct"),
                 ("(top_k)? [20]: ", ""),
                 ("Does the job have a `rollout` role", ""),
                 ("(roles.train.gpus)? [3]: ", "")])
    term.expect("wrote dualrun.yaml")
    assert term.ends() == 0
    plan = _plan(tmp_path / "dualrun.yaml")
    assert "method=gkd" in plan and "GPU 2        train rank 2  (world 3, local_rank 2)" in plan
    assert "GPU 3        teacher server 0" in plan


def test_an_existing_file_is_overwritten_only_on_yes(tmp_path):
    kept = tmp_path / "mine.yaml"
    kept.write_text("method: sft\n")
    term = Terminal(tmp_path, "--config_file", "mine.yaml")
    term.answer("mine.yaml exists; overwrite? [y/N]: ", "")
    term.expect("nothing written: mine.yaml is unchanged")
    assert term.ends() == 1
    assert kept.read_text() == "method: sft\n"


def test_no_terminal_is_refused_with_one_line_pointing_at_config_default(tmp_path):
    proc = dualrun("config", "--config_file", "x.yaml", cwd=tmp_path, input="")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "stdin: expected a terminal" in proc.stderr and "dualrun config default" in proc.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_the_questions_path_flag_before_default_is_refused_not_dropped(tmp_path):
    proc = dualrun("config", "--config_file", "x.yaml", "default", cwd=tmp_path)
    assert proc.returncode == 2 and "--config_file after `default`" in proc.stderr, proc.stderr
    assert not any(tmp_path.iterdir())
