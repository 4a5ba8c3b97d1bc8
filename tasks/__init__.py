"""Data plane: task adapters (prompt source + verifier), chosen by name or ``module:Class``.

>>> task = load_task("addition", digits=2, seed=0)
>>> task.next_prompts(2)[0].text   # doctest: +SKIP
'49+97='

Built in: ``addition`` (demo default), ``math`` (JSONL word problems, final-answer checking),
``reasoning-gym`` (optional extra, untested here), and the multi-turn environments ``poker``
(Kuhn poker against a fixed opponent) and ``guess`` (number guessing with higher/lower feedback).
Any class with the :class:`Task` attributes can be named as ``package.module:ClassName``; options
are passed to its constructor. A subclass of :class:`Environment` named that way becomes an
episodic task (:class:`EnvTask`, ``tasks/env.py``).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .base import EnvStep, Prompt, Task, TaskError
from .env import Environment, EnvTask, is_episodic

BUILTIN: dict[str, str] = {
    "addition": "echorl.tasks.addition:AdditionTask",
    "poker": "echorl.tasks.poker:KuhnPoker",
    "guess": "echorl.tasks.guess:GuessNumber",
    "math": "echorl.tasks.math_jsonl:MathJSONLTask",
    "reasoning-gym": "echorl.tasks.reasoning_gym_task:ReasoningGymTask",
}

_REQUIRED = ("next_prompts", "reward", "eval_prompts")


def _resolve(spec: str) -> type:
    target = BUILTIN.get(spec, spec)
    if ":" not in target:
        raise TaskError(
            f"unknown task {spec!r}: use one of {sorted(BUILTIN)} or 'package.module:ClassName'"
        )
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise TaskError(f"bad task spec {spec!r}: expected 'package.module:ClassName'")
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
    cls = _resolve(spec.strip())
    if isinstance(cls, type) and issubclass(cls, Environment):
        return EnvTask(cls, spec.strip(), **options)
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
    missing = [m for m in _REQUIRED if not callable(getattr(task, m, None))]
    if missing:
        raise TaskError(f"task {spec!r}: {cls.__name__} lacks {missing}")
    if not hasattr(task, "cursor"):
        raise TaskError(f"task {spec!r}: {cls.__name__} has no integer 'cursor'")
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


__all__ = ["BUILTIN", "EnvStep", "EnvTask", "Environment", "Prompt", "Task", "TaskError", "is_episodic", "load_task",
           "parse_task_options"]
