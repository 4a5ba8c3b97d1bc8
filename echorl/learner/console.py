"""What the learner says on its console while it trains: one progress line every
``PROGRESS_EVERY_S`` (step of the target, newest eval, nodes working, staleness, steps/s,
groups/s) and, while no node has joined, how to start one. Per-broadcast and per-step details are
DEBUG lines (``--log-level debug``); the metrics file has every figure of every step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 10.0
"""A line per 10 s: enough to see a run move, ~6 lines a minute in a log file."""
WAITING_HINT_EVERY_S = 20.0
"""While nobody has joined, the hint is repeated this often (a learner alone does nothing)."""


@dataclass(frozen=True)
class Progress:
    """The figures of one progress line, read from the loop and the peer book at one instant."""

    step: int
    steps_target: int
    eval_reward: float | None
    nodes: int
    staleness_max: int | None
    staleness_bound: int
    groups_per_s: float | None


def progress_line(now: Progress, before: Progress | None, seconds: float) -> str:
    """``step 120/700 · eval 0.612 · 3 nodes · staleness ≤ 4 (S=4) · 1.9 steps/s · 48.3 groups/s``."""
    target = f"/{now.steps_target}" if now.steps_target else ""
    ev = "-" if now.eval_reward is None else f"{now.eval_reward:.3f}"
    stale = "-" if now.staleness_max is None else str(now.staleness_max)
    rate = (now.step - before.step) / seconds if before is not None and seconds > 0 else None
    parts = [
        f"step {now.step}{target}",
        f"eval {ev}",
        f"{now.nodes} node{'s' if now.nodes != 1 else ''}",
        f"staleness ≤ {stale} (S={now.staleness_bound})",
        "- steps/s" if rate is None else f"{rate:.2f} steps/s",
        "- groups/s" if now.groups_per_s is None else f"{now.groups_per_s:.1f} groups/s",
    ]
    return " · ".join(parts)


def waiting_hint(bootstrap: str, run_id: str) -> str:
    run = "" if run_id == "echorl-demo" else f" --run-id {run_id}"
    return f"waiting for nodes; start one with: echorl node --bootstrap {bootstrap}{run}"


async def watch(
    read: Callable[[], Progress],
    bootstrap: str,
    run_id: str,
    *,
    every_s: float = PROGRESS_EVERY_S,
    hint_every_s: float = WAITING_HINT_EVERY_S,
    say: Callable[[str], Any] = log.info,
) -> None:
    """Forever: a progress line when something moved since the last one, the hint while no node works."""
    before: Progress | None = None
    t_before = time.monotonic()
    last_hint = -hint_every_s
    while True:
        await trio.sleep(min(every_s, hint_every_s))
        now, t = read(), time.monotonic()
        if now.nodes == 0 and now.step == (before.step if before else 0) and t - last_hint >= hint_every_s:
            say(waiting_hint(bootstrap, run_id))
            last_hint = t
        if t - t_before >= every_s and (before is None or now != before):
            if before is not None or now.step > 0:
                say(progress_line(now, before, t - t_before))
            before, t_before = now, t
