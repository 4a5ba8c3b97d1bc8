"""Plain data types exchanged between actors and the learner (no torch, picklable, and made of
JSON/msgpack-friendly fields so the network layer can encode them directly)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SamplingParams:
    """How to sample completions.

    temperature: softmax temperature; 0 means greedy. Behaviour log-probs are taken from
        ``log_softmax(logits / temperature)`` (temperature 1 when greedy), before top-p
        truncation; the learner must use the same temperature.
    top_p: nucleus sampling mass (1.0 = off).
    max_new_tokens: completion length limit (finish reason ``"length"``).
    stop: stop strings; the completion text is cut before the first one (finish ``"stop"``).
        The EOS token always stops.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 8
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Sample:
    """One completion: generated token ids (EOS included when generated), the behaviour
    log-prob of each token, ``"stop"`` or ``"length"``, and the decoded text (EOS and stop
    string excluded).

    An episode of a multi-turn task (``actor/episodes.py``) is one sample too: ``token_ids`` is
    the whole transcript after the prompt, model turns and environment observations
    interleaved; ``mask`` marks the tokens the model produced (only those carry behaviour
    log-probs, observations have 0.0, and only those enter the loss); ``reward`` is the node's
    account of the episode's reward (the learner replays it and compares)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    mask: list[bool] | None = None
    reward: float | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("token_ids and logprobs must have the same length")
        if self.mask is not None and len(self.mask) != len(self.token_ids):
            raise ValueError("mask and token_ids must have the same length")


@dataclass
class RolloutGroup:
    """G samples of one prompt, all produced by the policy of ``behaviour_version``.

    ``rewards`` are the actor's hints (or None); the learner recomputes them with the task's
    verifier. ``timings`` holds optional measurements (seconds) such as ``generate_s``.
    """

    prompt_id: str
    prompt_text: str
    prompt_token_ids: list[int]
    samples: list[Sample]
    behaviour_version: int
    rewards: list[float] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RolloutGroup:
        samples = [Sample(**s) for s in d["samples"]]
        return cls(
            prompt_id=d["prompt_id"],
            prompt_text=d["prompt_text"],
            prompt_token_ids=list(d["prompt_token_ids"]),
            samples=samples,
            behaviour_version=int(d["behaviour_version"]),
            rewards=None if d.get("rewards") is None else [float(r) for r in d["rewards"]],
            timings=dict(d.get("timings") or {}),
        )
