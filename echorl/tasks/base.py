"""Task adapter interface (data plane): prompt source + verifier (+ optional environment step).

A task is any object with the attributes of :class:`Task`. The core never imports a concrete
task; it goes through :func:`echorl.tasks.load_task`, so a user adds a task by writing a class
(``module:Class``) without touching the learner or the actors.

The prompt source is a pure function of an integer cursor: ``next_prompts(n)`` returns the
prompts at positions ``cursor .. cursor+n-1`` and advances the cursor. Saving the cursor (and the
re-queued prompts) is enough to resume a run without repeating or skipping prompts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass
class Prompt:
    """One prompt handed to actors.

    ``prompt_id`` is unique within a run (the learner uses it to match results and to
    de-duplicate); ``answer`` and ``meta`` are what the verifier needs and are never shown to
    the model. ``token_ids``: the prompt as token ids, used as given instead of tokenising
    ``text`` (``echorl serve``'s sampling requests: Tinker prompts are token ids). All fields are
    plain JSON/msgpack-friendly types.
    """

    prompt_id: str
    text: str
    answer: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    token_ids: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Prompt:
        return cls(
            prompt_id=str(d["prompt_id"]),
            text=str(d["text"]),
            answer=str(d.get("answer", "")),
            meta=dict(d.get("meta") or {}),
            token_ids=[int(t) for t in d["token_ids"]] if d.get("token_ids") else None,
        )


@dataclass
class EnvStep:
    """Result of one environment step of a (possibly multi-turn) task.

    ``done`` ends the episode; otherwise ``observation`` is appended to the transcript and the
    model continues. ``reward`` is the reward of the episode so far (final when ``done``).
    """

    done: bool
    reward: float
    observation: str | None = None


@dataclass(frozen=True)
class Query:
    """A question to the policy for an exact evaluation: how likely is ``text`` as the next turn?

    ``turns`` is the episode so far (the prompt, then action, observation, action, …), each piece
    tokenised on its own and concatenated as the rollout loop does; ``end``: the turn must end
    there with EOS (a single-turn answer), else it is the whole turn (a one-token action).
    """

    turns: tuple[str, ...]
    text: str
    end: bool


class TurnPolicy(Protocol):
    """The policy under evaluation, as probabilities of turns (``rl/exact_eval.py``)."""

    def probs(self, queries: list[Query]) -> list[float]: ...


class TaskError(ValueError):
    """A task name, a ``module:Class`` spec or a task option is invalid."""


class Task:
    """Base class of task adapters. Subclasses implement :meth:`prompt_at`, :meth:`reward` and
    :meth:`eval_prompts`; the cursor handling and the single-turn environment are shared.

    Attributes:
        name: short name used in prompt ids, metrics and checkpoints.
        max_new_tokens: a sensible completion length budget for this task.
        stop: stop strings for sampling (the EOS token always stops).
    """

    name: str = "task"
    max_new_tokens: int = 32
    stop: list[str] = []

    def __init__(self) -> None:
        self.cursor: int = 0

    # -- prompt source -------------------------------------------------------------------
    def prompt_at(self, index: int) -> Prompt:
        """The training prompt at cursor position ``index`` (deterministic)."""
        raise NotImplementedError

    def next_prompts(self, n: int) -> list[Prompt]:
        """Return the next ``n`` training prompts and advance the cursor."""
        out = [self.prompt_at(self.cursor + i) for i in range(n)]
        self.cursor += n
        return out

    def seek(self, cursor: int) -> None:
        """Set the cursor (used on resume)."""
        if cursor < 0:
            raise TaskError(f"cursor must be >= 0, got {cursor}")
        self.cursor = int(cursor)

    # -- verifier ------------------------------------------------------------------------
    def reward(self, prompt: Prompt, completion_text: str) -> float:
        """Reward in [0, 1] of ``completion_text`` (the generated text, without the prompt)."""
        raise NotImplementedError

    def eval_prompts(self) -> list[Prompt]:
        """A fixed held-out prompt set (same list on every call, disjoint from training where
        the task allows it)."""
        raise NotImplementedError

    def exact_eval(self, prompts: list[Prompt], policy: TurnPolicy) -> float | None:
        """The expected reward of ``policy`` on ``prompts`` (the held-out set), computed without
        sampling; None where the task cannot (the loop then reports the sampled figure only)."""
        return None

    def exact_metrics(self, prompts: list[Prompt], policy: TurnPolicy) -> dict[str, float]:
        """Further exact figures of ``policy`` for the metrics row (Kuhn poker: its
        ``exploitability``); none by default."""
        return {}

    # -- environment (multi-turn tasks override) -----------------------------------------
    def env_step(self, prompt: Prompt, transcript: str) -> EnvStep:
        """One environment step given the model's transcript so far. Single-turn default:
        the episode ends after the first completion and is scored by :meth:`reward`."""
        return EnvStep(done=True, reward=self.reward(prompt, transcript))
