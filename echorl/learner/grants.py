"""How fast the learner grants leases: no faster than its loop can check what comes back.

A lease granted now is a submission one lease-time later, and submissions come back about as
bunched as their grants went out. At 1,000 peers that joined within a minute, the learner granted
their first leases within two seconds; ten seconds later (their work) 250 submissions a second
arrived, more than its loop checks (~200 a second at 4.5 ms each), and for five seconds every lease
request waited 0.3-0.6 s behind that backlog, where before and after it took under 50 ms
(``bench/swarm.py --events-out``, issue 27). So grants are paced to the loop's capacity:
``GrantPace`` is a token bucket whose rate is ``UTILIZATION`` of what the loop can check, measured
as the loop thread's CPU per accepted submission (everything the loop does, leases and pings
included, divided by what it achieved). A request the bucket cannot serve is deferred
(``paced``) to the next free slot of a shared clock, so a crowd deferred at once comes back one
slot apart, not together. At a swarm's steady state grants equal submissions, so the bucket binds
only when grants come faster than the learner could check them: a mass join, or more volunteers
than one learner can serve (then they wait, and the learner stays responsive).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from echorl.learner.pace import SlotClock

UTILIZATION = 0.6
"""The share of the loop's measured capacity that grants may fill: room for a lease's own requests,
joins, pings and status reads, and for submissions that come back closer together than their grants
went out (a lease's work varies)."""
PRIOR_COST_S = 0.005
"""The loop's seconds per submission assumed until measured: 4.5-5 ms at 1,000 peers on this 2-core
machine (``bench/swarm.py``), so a swarm that arrives at once is paced from its first lease."""
COST_RANGE = (PRIOR_COST_S / 10, PRIOR_COST_S * 10)
"""A measured cost is taken within these bounds (12 to 1,200 grants a second): a loop busy with
hostile requests that are refused makes each accepted submission look dear, and must not stop the
grants of a small honest swarm."""
MEASURE_S = 10.0
"""The cost is measured over windows this long (a few lease times of a fast fleet)."""
MIN_MEASURED = 100
"""Submissions a window needs before its cost replaces the last: at a few a second the loop's fixed
work (pings, upkeep) would count as the submissions' cost, and the bucket binds only at rates of
hundreds a second anyway."""
BURST_S = 1.0
"""Seconds of grants the bucket holds: a fleet's ordinary clumping is not deferred."""
MAX_WAIT_S = 30.0
"""The longest ``retry_after_s`` a deferred asker is given, however long the queue of slots."""


class GrantPace:
    """The lease-grant token bucket and its slot clock; the service asks ``wait_s`` before each
    grant and calls ``note_submission`` for each accepted submission. ``cpu`` is the loop thread's
    CPU clock (every call comes from the loop)."""

    def __init__(self, cpu: Callable[[], float] = time.thread_time) -> None:
        self.cpu = cpu
        self.cost_s = PRIOR_COST_S  # the loop's seconds per submission (PRIOR_COST_S until measured)
        self.deferred = 0  # requests deferred by the bucket (the metrics row)
        self._tokens = self.rate * BURST_S
        self._at = -1.0  # when the bucket was last refilled (-1: never)
        self._slots = SlotClock()  # when deferred askers should come back
        self._window: tuple[float, float] | None = None  # (started, loop CPU then)
        self._submitted = 0  # accepted submissions since the window started

    @property
    def rate(self) -> float:
        """Grants a second the bucket allows."""
        return UTILIZATION / self.cost_s

    def note_submission(self) -> None:
        self._submitted += 1

    def wait_s(self, now: float) -> float:
        """0: a lease may be granted now (it takes a token); else the seconds this asker should
        wait (its slot on the shared clock, at most ``MAX_WAIT_S``)."""
        self._measure(now)
        if self._at >= 0:
            self._tokens = min(self.rate * BURST_S, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        self.deferred += 1
        return self._slots.take(now, 1.0 / self.rate, (1.0 - self._tokens) / self.rate, MAX_WAIT_S)

    def _measure(self, now: float) -> None:
        if self._window is not None and now - self._window[0] < MEASURE_S:
            return
        cpu, n = self.cpu(), self._submitted
        if self._window is not None and n >= MIN_MEASURED and cpu > self._window[1]:
            self.cost_s = min(max((cpu - self._window[1]) / n, COST_RANGE[0]), COST_RANGE[1])
        self._window, self._submitted = (now, cpu), 0

    def metrics(self) -> dict[str, int]:
        return {"lease_grants_per_s_max": round(self.rate), "leases_deferred_by_grant_pace": self.deferred}
