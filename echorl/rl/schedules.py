"""Settings that change over a run's optimizer steps: the learning rate (``--lr-schedule``) and the
entropy bonus (``--entropy-schedule``).

A schedule is a function of the step alone (the trainer's version before the step), so a resumed
run goes on where it was without scheduler state, and every data-parallel rank, counting the same
versions, computes the same value.
"""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["constant", "linear", "cosine"]
SCHEDULES: tuple[Schedule, ...] = ("constant", "linear", "cosine")


def anneal(kind: Schedule, start: float, end: float, step: int, steps: int) -> float:
    """``start`` at step 0, ``end`` from step ``steps`` − 1 on: along a straight line ('linear') or
    half a cosine ('cosine', flat at both ends); 'constant' (or ``steps`` ≤ 1: a run without an
    end) is ``start`` throughout."""
    if kind not in SCHEDULES:
        raise ValueError(f"a schedule is one of {', '.join(SCHEDULES)}, got {kind!r}")
    if kind == "constant" or steps <= 1:
        return start
    progress = min(1.0, max(0, step) / (steps - 1))
    weight = 1.0 - progress if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return end + (start - end) * weight
