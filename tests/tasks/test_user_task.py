"""A user's task: found in the working directory, a failing verifier scores 0 and is counted
(never stops a run), the README's example works, and the optional reasoning-gym adapter trains."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from echorl.tasks import Prompt, RewardGuard, Task, TaskError, load_task, reward_errors

README = Path(__file__).resolve().parents[2] / "README.md"


class _Flaky(Task):
    name = "flaky"

    def __init__(self) -> None:
        super().__init__()
        self.answers = {
            "raise": ZeroDivisionError("boom"),
            "nan": math.nan,
            "none": None,
            "str": "1.0",
            "inf": math.inf,
            "ok": 1.0,
            "bool": True,
            "int": 0,
        }

    def prompt_at(self, index: int) -> Prompt:
        return Prompt(f"flaky:{index}", "x", "")

    def reward(self, prompt: Prompt, completion_text: str):
        value = self.answers[completion_text]
        if isinstance(value, Exception):
            raise value
        return value

    def eval_prompts(self) -> list[Prompt]:
        return [self.prompt_at(0)]


def test_failing_verifier_scores_zero_is_counted_and_logged_once(caplog):
    task = load_task(f"{__name__}:_Flaky")
    assert isinstance(task.reward, RewardGuard)
    p = task.prompt_at(0)
    with caplog.at_level(logging.WARNING, logger="echorl.tasks"):
        got = {k: task.reward(p, k) for k in ("raise", "nan", "none", "str", "inf", "raise")}
        good = [task.reward(p, "ok"), task.reward(p, "bool"), task.reward(p, "int")]
    assert got == {k: 0.0 for k in got} and good == [1.0, 1.0, 0.0]
    assert all(type(v) is float for v in good)
    assert reward_errors(task) == 6
    warnings = [r for r in caplog.records if r.name == "echorl.tasks"]
    assert (
        len(warnings) == 1 and "flaky" in warnings[0].getMessage() and "ZeroDivisionError" in warnings[0].getMessage()
    )


def test_unguarded_task_reports_zero_errors():
    assert reward_errors(_Flaky()) == 0


def _readme_example() -> str:
    m = re.search(r"```python\n(# my_task\.py.*?)```", README.read_text(), re.S)
    assert m, "README lost its example task"
    return m.group(1)


def test_module_in_working_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "my_task.py").write_text(_readme_example())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_task", raising=False)
    task = load_task("my_task:MaxTask")
    p = task.next_prompts(1)[0]
    a, b = map(int, re.findall(r"\d", p.text))
    assert task.reward(p, f" {max(a, b)}") == 1.0 and task.reward(p, "x") == 0.0
    assert len(task.eval_prompts()) > 0 and reward_errors(task) == 0
    with pytest.raises(TaskError, match="cannot import module"):
        load_task("not_here_xyz:MaxTask")


def _train_local(cwd: Path, model: Path, *args: str) -> list[dict]:
    out = cwd / "m.jsonl"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "echorl.cli",
            "train-local",
            "--model",
            str(model),
            "--steps",
            "2",
            "--actors",
            "1",
            "--group-size",
            "2",
            "--prompts-per-step",
            "2",
            "--lease-prompts",
            "2",
            "--eval-every",
            "2",
            "--quiet",
            "--metrics-out",
            str(out),
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.fixture(scope="module")
def untrained_model(tmp_path_factory) -> Path:
    from echorl.actor.model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("model") / "m", warmup=None)


def test_readme_example_trains_in_train_local(tmp_path, untrained_model):
    (tmp_path / "my_task.py").write_text(_readme_example())
    rows = _train_local(tmp_path, untrained_model, "--task", "my_task:MaxTask")
    assert rows[-1]["step"] == 2 and rows[-1]["reward_errors"] == 0


def test_broken_verifier_run_goes_on(tmp_path, untrained_model):
    (tmp_path / "broken_task.py").write_text(
        _readme_example().replace("class MaxTask", "class _Base")
        + ("\nclass Broken(_Base):\n    def reward(self, prompt, text):\n        raise RuntimeError('verifier bug')\n")
    )
    rows = _train_local(tmp_path, untrained_model, "--task", "broken_task:Broken")
    assert rows[-1]["step"] == 2 and rows[-1]["reward_errors"] >= 2 * 2 * 2


def test_reasoning_gym_procedural_task(tmp_path, untrained_model):
    pytest.importorskip("reasoning_gym")
    task = load_task("reasoning_gym:basic_arithmetic", size=50, n_eval=4, seed=3)
    p = task.next_prompts(1)[0]
    assert task.reward(p, p.answer) == 1.0 and task.reward(p, "no idea") == 0.0
    other = load_task("reasoning-gym", dataset="basic_arithmetic", size=50, n_eval=4, seed=3)
    assert other.prompt_at(0) == p and other.reward(p, f"The answer is {p.answer}") == 1.0
    assert len(task.eval_prompts()) == 4 and task.eval_prompts()[0].text != p.text
    forged = Prompt("reasoning-gym:0", p.text, p.answer, {"split": "train", "index": 10**9})
    assert task.reward(forged, p.answer) == 0.0 and reward_errors(task) == 1
    rows = _train_local(
        tmp_path,
        untrained_model,
        "--task",
        "reasoning_gym:basic_arithmetic",
        "--task-option",
        "size=20",
        "--task-option",
        "n_eval=2",
        "--task-option",
        "max_new_tokens=4",
    )
    assert rows[-1]["step"] == 2 and rows[0]["eval_reward"] is not None


def _readme_task_with_two_mistakes() -> str:
    """The README's task as a user may first write it: an ``__init__`` that does not call
    ``super().__init__()`` and no ``eval_prompts``."""
    code = _readme_example()
    code = re.sub(r"\n    def eval_prompts\(self\):\n.*?\n(?=\S|\Z)", "\n", code, flags=re.S)
    assert "eval_prompts" not in code
    no_super = "    def __init__(self):\n        self.seen = 0\n"
    return code.replace("    def prompt_at(self, i):", no_super + "    def prompt_at(self, i):")


def test_a_task_missing_its_cursor_and_eval_prompts_is_told_both_at_once(tmp_path, monkeypatch):
    (tmp_path / "half_task.py").write_text(_readme_task_with_two_mistakes())
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "half_task", raising=False)
    with pytest.raises(TaskError) as err:
        load_task("half_task:MaxTask")
    assert str(err.value) == (
        "task 'half_task:MaxTask': MaxTask does not define eval_prompts(); has no integer 'cursor': its __init__ "
        "must call super().__init__()"
    )


@pytest.mark.parametrize("role", ["learner", "train-local", "demo"])
def test_every_role_refuses_such_a_task_in_one_line_before_starting(tmp_path, role):
    (tmp_path / "half_task.py").write_text(_readme_task_with_two_mistakes())
    r = subprocess.run(
        [sys.executable, "-m", "echorl.cli", role, "--task", "half_task:MaxTask"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-3000:]
    assert r.stderr.startswith(f"echorl {role}: task 'half_task:MaxTask': MaxTask does not define eval_prompts()")
    assert "super().__init__()" in r.stderr and not (tmp_path / "runs").exists()
