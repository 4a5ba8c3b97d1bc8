"""Data plane: task adapters (prompt source + verifier), chosen by name or ``module:Class``.

>>> task = load_task("addition", digits=2, seed=0)
>>> task.next_prompts(2)[0].text   # doctest: +SKIP
'49+97='

Built in: ``addition`` (demo default), ``arithmetic`` ("What is 7 + 5?" for a chat model),
``math`` (JSONL word problems, final-answer checking), ``reasoning-gym`` (optional extra
``tasks``; ``reasoning_gym:NAME`` picks a generator), and the
multi-turn environments ``poker`` (Kuhn poker against a fixed opponent) and ``guess`` (number
guessing with higher/lower feedback). Any class with the :class:`Task` attributes can be named as
``package.module:ClassName`` (modules in the current working directory are found too); options
are passed to its constructor. A subclass of :class:`Environment` named that way becomes an
episodic task (:class:`EnvTask`, ``tasks/env.py``). ``chat.py``: a single-turn task's prompts in the
model's chat template (``with_chat_template``).

A user's verifier is untrusted code: :func:`load_task` wraps ``task.reward`` in a
:class:`RewardGuard`, so a verifier that raises or returns a non-number scores that sample 0,
is counted (:func:`reward_errors`, the ``reward_errors`` metric) and logged once, and the run
goes on.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import numbers
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from .base import EnvStep, Prompt, Task, TaskError
from .env import Environment, EnvTask, is_episodic

BUILTIN: dict[str, str] = {
    "addition": "echorl.tasks.addition:AdditionTask",
    "arithmetic": "echorl.tasks.arithmetic:ArithmeticTask",
    "poker": "echorl.tasks.poker:KuhnPoker",
    "guess": "echorl.tasks.guess:GuessNumber",
    "math": "echorl.tasks.math_jsonl:MathJSONLTask",
    "reasoning-gym": "echorl.tasks.reasoning_gym_task:ReasoningGymTask",
}

_REQUIRED = ("next_prompts", "reward", "eval_prompts")
log = logging.getLogger("echorl.tasks")


class RewardGuard:
    """``task.reward`` made safe to call from the learner: an exception or a result that is not
    a finite number (NaN, inf, None, a string, ...) becomes reward 0.0 and increments
    :attr:`errors`; the first such failure is logged with the task's name (not every one: a
    broken verifier would otherwise flood the log once per sample). Thread-safe: the learner
    scores in worker threads."""

    def __init__(self, task_name: str, reward: Callable[[Prompt, str], Any]) -> None:
        self.task_name, self.inner = task_name, reward
        self.errors = 0
        self._lock = threading.Lock()

    def __call__(self, prompt: Prompt, completion_text: str) -> float:
        try:
            value = self.inner(prompt, completion_text)
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise TypeError(f"reward returned {value!r} (type {type(value).__name__}), not a finite number")
            return float(value)
        except Exception as exc:  # the verifier is user code: any failure scores 0, never stops the run
            with self._lock:
                self.errors += 1
                first = self.errors == 1
            if first:
                log.warning(
                    "task %r: reward failed for prompt %r, scored 0 (further failures are only "
                    "counted in reward_errors): %s: %s",
                    self.task_name,
                    getattr(prompt, "prompt_id", "?"),
                    type(exc).__name__,
                    exc,
                )
            return 0.0


def reward_errors(task: Any) -> int:
    """How many samples the task's verifier failed on so far (0 for an unguarded task)."""
    return int(getattr(getattr(task, "reward", None), "errors", 0))


def _resolve(spec: str) -> type:
    target = BUILTIN.get(spec, spec)
    if ":" not in target:
        raise TaskError(f"unknown task {spec!r}: use one of {sorted(BUILTIN)} or 'package.module:ClassName'")
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise TaskError(f"bad task spec {spec!r}: expected 'package.module:ClassName'")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # appended: a user's file never shadows an installed module
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"task {spec!r}: cannot import module {module_name!r} ({exc})") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise TaskError(f"task {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return cls


def load_task(spec: str, **options: Any) -> Task:
    """Create a task from a built-in name or ``module:Class`` and constructor options.

    Raises :class:`TaskError` with a readable message for an unknown name, an unimportable
    module, a missing class, an unknown option or a class that lacks the task methods.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise TaskError(f"task spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    for prefix in ("reasoning_gym:", "reasoning-gym:"):
        if spec.startswith(prefix) and spec[len(prefix) :]:
            options = {**options, "dataset": spec[len(prefix) :]}
            spec = "reasoning-gym"
    cls = _resolve(spec)
    if isinstance(cls, type) and issubclass(cls, Environment):
        return _guarded(EnvTask(cls, spec, **options), spec)
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        params = {}
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = [k for k in options if k not in params and not takes_kwargs]
    if unknown:
        allowed = [k for k in params if k not in ("self",)]
        raise TaskError(f"task {spec!r}: unknown option(s) {unknown}; allowed: {allowed}")
    try:
        task = cls(**options)
    except TaskError:
        raise
    except (TypeError, ValueError) as exc:
        raise TaskError(f"task {spec!r}: bad options {options}: {exc}") from None
    problems = _incomplete(task)
    if problems:
        raise TaskError(f"task {spec!r}: {cls.__name__} {'; '.join(problems)}")
    return _guarded(task, spec)


def _incomplete(task: Any) -> list[str]:
    """Everything a user's task lacks, by name, so one message lists it all: a method it does not
    define (or leaves as :class:`Task`'s, which only raises), and no ``cursor`` because its
    ``__init__`` did not call ``super().__init__()``."""
    is_task = isinstance(task, Task)
    inherited = lambda m: is_task and getattr(type(task), m) is getattr(Task, m)  # Task's raises NotImplementedError
    missing = [m for m in _REQUIRED if not callable(getattr(task, m, None)) or inherited(m)]
    if "next_prompts" in missing and is_task and not inherited("prompt_at"):
        missing.remove("next_prompts")  # Task.next_prompts reads the subclass's prompt_at
    elif "next_prompts" in missing and is_task:
        missing[missing.index("next_prompts")] = "prompt_at"
    out = [f"does not define {', '.join(f'{m}()' for m in missing)}"] if missing else []
    if not isinstance(getattr(task, "cursor", None), int):
        out.append(
            "has no integer 'cursor': its __init__ must call super().__init__()"
            if is_task
            else "has no integer 'cursor' (the prompt source's position, saved in checkpoints)"
        )
    return out


def _guarded(task: Any, spec: str) -> Any:
    if not isinstance(task.reward, RewardGuard):
        task.reward = RewardGuard(str(getattr(task, "name", spec)), task.reward)
    return task


def parse_task_options(items: list[str] | None) -> dict[str, Any]:
    """Parse ``["digits=3", "path=x.jsonl"]`` (CLI ``--task-option``) into typed options
    (ints, floats, true/false are converted; anything else stays a string)."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise TaskError(f"task option {item!r} must look like key=value")
        value: Any = raw
        if raw.lower() in ("true", "false"):
            value = raw.lower() == "true"
        else:
            for conv in (int, float):
                try:
                    value = conv(raw)
                    break
                except ValueError:
                    pass
        out[key] = value
    return out


__all__ = [
    "BUILTIN",
    "EnvStep",
    "EnvTask",
    "Environment",
    "Prompt",
    "RewardGuard",
    "Task",
    "TaskError",
    "is_episodic",
    "load_task",
    "parse_task_options",
    "reward_errors",
]
