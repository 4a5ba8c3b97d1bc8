"""Replay verification of multi-turn episodes: the learner never trusts a node's account of an
environment.

A submitted episode is the prompt (the learner's own first observation of the seed it chose),
a transcript of token ids and a mask of the tokens the model produced. The learner re-runs the
episode with its own copy of the environment under the referee (``tasks/env.py``): each maximal
run of model tokens is one model turn, which must end exactly where sampling would have ended it
(EOS, a stop string, or the turn's token limit); its decoded text (cut at the stop string) is
the action; the environment's next observation, tokenized by the learner, must be exactly the
masked tokens that follow; the transcript must end exactly where the episode does (done, turn
limit, token budget, environment error). The reward is the replay's; a node's own reward that
differs is a forgery too. Any difference raises :class:`ReplayMismatch` (the service answers
``env_mismatch`` and counts it against the peer like a log-prob mismatch).

Pure CPU work on small transcripts: the service runs it in a worker thread, within a
:class:`ReplayBudget` of CPU seconds for one submission (:data:`REPLAY_CPU_BUDGET_S`): past it
the replay stops with :class:`ReplayOverBudget` (the service answers ``unverifiable``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from echorl.actor.types import RolloutGroup, Sample
from echorl.protocol.messages import EpisodeSpec
from echorl.tasks.base import Prompt

if TYPE_CHECKING:
    from echorl.rl.seams import Tokenizer
    from echorl.tasks.base import Task
    from echorl.tasks.env import EnvTask

REWARD_TOLERANCE = 1e-6


REPLAY_CPU_BUDGET_S = 5.0
"""CPU seconds the learner spends replaying the episodes of one submission before it stops and
refuses it ``unverifiable`` (re-queued, not counted against the peer). Honest submissions of the
built-in environments replay in milliseconds (32 ``guess`` episodes of the tiny model, 308 tokens:
4.7 ms CPU), and the cost is ~linear in the transcript (a 2,000-token turn is checked in ≤ 3
decodes), so 5 s leaves room of about three orders of magnitude for long honest episodes, while
one submission can no longer hold a worker thread for the ~56 s a 2,000-token-turn episode took
when decoding was quadratic (issue 24). CPU time of the replaying thread, not wall time: a loaded
machine does not make honest work fail, and the figure bounds what a submission costs the
learner."""


class ReplayMismatch(ValueError):
    """A transcript's observations, boundaries or reward differ from the learner's replay."""


class ReplayOverBudget(RuntimeError):
    """One submission's replay spent its :class:`ReplayBudget`: the learner could not check it
    (not a proof of forgery)."""


class ReplayBudget:
    """The CPU seconds one submission's replay may spend. ``clock`` (default: the CPU time of the
    calling thread) is first read at the first :meth:`spend`, in the thread that replays, so a
    budget may be made on the event loop and spent in a worker thread."""

    def __init__(self, seconds: float = REPLAY_CPU_BUDGET_S, clock: Callable[[], float] = time.thread_time) -> None:
        self.seconds, self.clock = float(seconds), clock
        self.start: float | None = None

    def spend(self, where: str) -> None:
        """Raise :class:`ReplayOverBudget` if more than ``seconds`` passed on ``clock`` since the
        first call (``where``: what was about to be replayed, for the message)."""
        now = self.clock()
        if self.start is None:
            self.start = now
        elif now - self.start > self.seconds:
            raise ReplayOverBudget(f"replay over its budget of {self.seconds:g} CPU s at {where}")


class Replayer:
    """Replays episodes of ``task`` (an :class:`~echorl.tasks.env.EnvTask`) with ``tokenizer``."""

    def __init__(self, task: EnvTask, tokenizer: Tokenizer, max_tokens: int | None = None) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens or task.max_episode_tokens)
        self.turn_tokens = int(task.max_new_tokens)
        self.stop = list(task.stop)
        eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _stopped(self, ids: list[int]) -> bool:
        text = self._decode(ids) if self.stop else ""
        return any(s in text for s in self.stop)

    def _first_stop(self, turn: list[int]) -> int:
        """The shortest proper prefix of ``turn`` whose text holds a stop string (one exists).
        A prefix's text is a prefix of a longer one's, so "holds a stop string" only turns on as
        the prefix grows: a binary search, ~log2(n) decodes. An accepted turn costs one decode of
        its proper prefix, not one per token (a 2,000-token turn was ~2,000 decodes: issue 24)."""
        lo, hi = 1, len(turn) - 1  # turn[:hi] holds one
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if self._stopped(turn[:mid]) else (mid + 1, hi)
        return lo

    def action(self, turn: list[int], k: int) -> str:
        """The action text of model turn ``k``; refuses a turn sampling would not have produced."""
        if not turn:
            raise ReplayMismatch(f"turn {k}: no model tokens where the model was to act")
        if len(turn) > self.turn_tokens:
            raise ReplayMismatch(f"turn {k}: {len(turn)} tokens > the turn limit {self.turn_tokens}")
        early = next((i for i, t in enumerate(turn[:-1], 1) if t in self.eos_ids), 0)
        if not early and len(turn) > 1 and self._stopped(turn[:-1]):
            early = self._first_stop(turn)
        if early:  # sampling stops at the first EOS or stop string
            raise ReplayMismatch(f"turn {k}: goes on after it ended at token {early}")
        if len(turn) < self.turn_tokens and turn[-1] not in self.eos_ids and not self._stopped(turn):
            raise ReplayMismatch(f"turn {k}: cut short ({len(turn)} tokens, no EOS or stop string)")
        text = self._decode(turn)
        cuts = [text.find(s) for s in self.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def episode(self, prompt: Prompt, sample: Sample, budget: ReplayBudget | None = None) -> float:
        """The replayed reward of one episode, or :class:`ReplayMismatch`; ``budget`` is spent
        before each turn (:class:`ReplayOverBudget` once it is gone)."""
        toks, mask = list(sample.token_ids), sample.mask
        if mask is None or len(mask) != len(toks):
            raise ReplayMismatch("an episode needs a model mask as long as its transcript")
        run = self.task.run(int(prompt.meta["env_seed"]), prompt.meta.get("env_options"))
        if run.observation != prompt.text:
            raise ReplayMismatch("the environment's first observation differs from the prompt")
        i, k = 0, 0
        while not run.over:
            if budget is not None:
                budget.spend(f"turn {k}")
            j = i
            while j < len(toks) and mask[j]:
                j += 1
            obs = run.act(self.action(toks[i:j], k))
            i, k = j, k + 1
            if obs is None:
                break
            expected = self.encode(obs)
            if i + len(expected) + self.turn_tokens > self.max_tokens:
                run.cut()
                break
            if toks[i : i + len(expected)] != expected or any(mask[i : i + len(expected)]):
                raise ReplayMismatch(f"observation after turn {k - 1} differs from the environment's")
            i += len(expected)
        if i != len(toks):
            raise ReplayMismatch(f"transcript goes on after the episode ended ({run.finish}) at token {i}")
        if sample.reward is not None and abs(float(sample.reward) - run.reward) > REWARD_TOLERANCE:
            raise ReplayMismatch(f"claimed reward {sample.reward} but the replay gives {run.reward}")
        return float(run.reward)

    def group(self, prompt: Prompt, group: RolloutGroup, budget: ReplayBudget | None = None) -> list[float]:
        """Replayed rewards of every episode of a group (the buffer's ``group_scorer``), all
        within one ``budget`` when given."""
        return [self.episode(prompt, s, budget) for s in group.samples]


def episode_spec(task: Task, prompt: Prompt) -> EpisodeSpec | None:
    """The lease's ``EpisodeSpec`` for a prompt of an episodic task (None: single-turn)."""
    from echorl.tasks.env import env_options_of, is_episodic

    if not is_episodic(task):
        return None
    task = cast("EnvTask", task)
    return EpisodeSpec(
        env=task.spec,
        options=env_options_of(task, prompt),
        seed=int(prompt.meta["env_seed"]),
        max_turns=task.max_turns,
        max_tokens=task.max_episode_tokens,
    )


def group_scorer(
    task: Task, tokenizer: Tokenizer
) -> Callable[[Prompt, RolloutGroup, ReplayBudget | None], list[float]] | None:
    """The buffer's group scorer for an episodic task, None for a single-turn one."""
    from echorl.tasks.env import is_episodic

    return Replayer(cast("EnvTask", task), tokenizer).group if is_episodic(task) else None
