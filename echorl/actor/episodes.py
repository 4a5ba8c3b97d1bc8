"""The agent–environment loop of multi-turn tasks: episodes sampled in lock-step batches.

For each environment seed, ``group_size`` episodes start from the environment's first
observation. Every round, the still-running episodes are sampled one model turn each in one
batch (``backend.sample_ids``: per-token behaviour log-probs given the whole transcript so far),
each turn's text goes to its environment through the referee (:class:`EpisodeRun`,
``tasks/env.py``), and the observation that follows is tokenized and appended, masked out
(log-prob 0.0). An episode ends when the environment says done, at the turn limit, when the
next observation would overflow ``max_tokens``, or when the environment raises (reward 0, the
reason is logged). The learner replays every transcript with the same referee
(``learner/replay.py``), so these rules are part of the protocol.

Runs in the caller's thread (a worker thread on a node): no trio here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from echorl.tasks.base import Prompt
from echorl.tasks.env import EpisodeRun

from .seeded import SeededRows
from .types import Sample, SamplingParams

log = logging.getLogger("echorl.actor.episodes")

FINISH = {"done": "stop", "env_error": "stop", "turn_limit": "length", "length": "length"}


@dataclass
class _Live:
    run: EpisodeRun
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)


def turn_params(task: Any, params: SamplingParams) -> SamplingParams:
    """Sampling of one model turn: the lease's temperature/top-p, the task's turn length."""
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        max_new_tokens=int(task.max_new_tokens),
        stop=list(task.stop),
    )


def run_episodes(
    backend: Any,
    task: Any,
    env_seeds: list[int],
    group_size: int,
    params: SamplingParams,
    max_tokens: int,
    seed: int | None = None,
    sampling_seed: int | None = None,
    env_options: list[dict[str, Any] | None] | None = None,
) -> tuple[list[str], list[list[Sample]]]:
    """``group_size`` episodes per environment seed, in seed order; returns each seed's first
    observation (the prompt) and its episodes as :class:`Sample` (``mask`` and ``reward`` set).
    ``sampling_seed`` (a lease's): every model turn is a seeded sample (``actor/seeded.py``):
    episode ``k·G + j`` is sample ``k·G + j``, a token's position is its offset in the transcript
    (observations included), so the learner replays every action the model took.
    ``env_options``: each seed's option overrides (a prompt's, e.g. self-play's opponent)."""
    live: list[_Live] = []
    prompts: list[str] = []
    overrides = env_options or [None] * len(env_seeds)
    for env_seed, options in zip(env_seeds, overrides, strict=True):
        runs = [task.run(env_seed, options) for _ in range(group_size)]
        prompts.append(runs[0].observation)
        ids = backend.encode(runs[0].observation)
        live.extend(_Live(run, ids) for run in runs)
    turn = turn_params(task, params)
    rnd = 0
    while True:
        index = [i for i, e in enumerate(live) if not e.run.over]
        active = [live[i] for i in index]
        if not active:
            break
        rows = [e.prompt_ids + e.tokens for e in active]
        seeded = None
        if sampling_seed is not None:
            seeded = SeededRows(int(sampling_seed), index, [len(e.tokens) for e in active], turn.max_new_tokens)
        draws = backend.sample_ids(rows, turn, None if seed is None else seed * 1_000_003 + rnd, seeded)
        rnd += 1
        for e, s in zip(active, draws):
            _advance(backend, e, s, max_tokens, turn.max_new_tokens)
    out = []
    for e in live:
        text = backend.tokenizer.decode(e.tokens, skip_special_tokens=True)
        out.append(
            Sample(
                token_ids=e.tokens,
                logprobs=e.logprobs,
                finish_reason=FINISH.get(e.run.finish, "stop"),
                text=text,
                mask=e.mask,
                reward=float(e.run.reward),
            )
        )
    return prompts, [out[i * group_size : (i + 1) * group_size] for i in range(len(env_seeds))]


def _advance(backend: Any, e: _Live, s: Sample, max_tokens: int, turn_tokens: int) -> None:
    e.tokens.extend(s.token_ids)
    e.logprobs.extend(s.logprobs)
    e.mask.extend([True] * len(s.token_ids))
    obs = e.run.act(s.text)
    if obs is None:
        return
    obs_ids = backend.encode(obs)
    if len(e.tokens) + len(obs_ids) + turn_tokens > max_tokens:
        e.run.cut()
        return
    e.tokens.extend(obs_ids)
    e.logprobs.extend([0.0] * len(obs_ids))
    e.mask.extend([False] * len(obs_ids))


def evaluate(backend: Any, task: Any, prompts: list[Prompt], params: SamplingParams, seed: int) -> float:
    """Mean episode reward of one sampled episode per held-out prompt (fixed seed)."""
    seeds = [int(p.meta["env_seed"]) for p in prompts]
    _, groups = run_episodes(backend, task, seeds, 1, params, task.max_episode_tokens, seed=seed)
    return sum(float(g[0].reward or 0.0) for g in groups) / max(1, len(groups))
