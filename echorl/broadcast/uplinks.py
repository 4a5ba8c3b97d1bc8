"""The learner's measurement of each member's relaying upload: the plan's weights (issue 27).

A relay's uplink is what its plan children received from it, timed by them: each child reports
per stripe the bytes that came from its plan parent after the first chunk and the seconds their
frames were in transit, each frame's first byte to its last (``BroadcastDone.streams``). The
waits between frames are left out: a relay forwards no faster than it is fed, but each chunk,
once it has it, goes out at its uplink's share, so a relay whose feed is slow is not measured
as slow (timing the whole stream would: a fast relay under a slow one would look slow and never
be given the slots to show otherwise). The learner takes a report only from a member that completed
the version, only about that member's own parent in that stripe (the plan says who), and bounds
it where it enters: bytes at most the stripe's (from the signed manifest), seconds at least
``MIN_SECONDS``. A parent's rate for one version is its reported streams' count × their
median rate (the lower median: they run side by side, sharing its uplink, so honest children
see about the same rate, and a minority of lying ones moves neither way), averaged with the
last one; it is kept ``KEEP_FOR`` publications without a new one. ``weight`` is that rate in ``WEIGHT_UNIT`` steps on a
quarter-octave ladder, in [1, ``MAX_WEIGHT``]; a peer not measured gets None, which the
planner reads as the median weight.
A member never states its own uplink, and a weight earns nothing: it only sets how many child
slots a relay has (at most ``MAX_COPIES`` copies of a version, ``protocol/plan.py``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping

from echorl.protocol.messages import BroadcastDone, Manifest
from echorl.protocol.plan import MAX_WEIGHT, BroadcastPlan

WEIGHT_UNIT = 12_500.0  # bytes/s per unit of weight (100 kbit/s)
MIN_SECONDS = 0.05  # a stream's reported seconds are floored here
KEEP_FOR = 16  # publications a measurement is used without a newer one


def weight_of(rate: float) -> int:
    """A measured upload (bytes/s) as a plan weight: in ``WEIGHT_UNIT`` steps, rounded to a
    quarter octave (so that a measurement moving by a few percent leaves the plan, and the
    connections it reuses, as they were), in [1, ``MAX_WEIGHT``]."""
    units = min(max(rate / WEIGHT_UNIT, 1.0), float(MAX_WEIGHT))
    return int(min(round(2 ** (round(4 * math.log2(units)) / 4)), MAX_WEIGHT))


def stripe_bytes(manifest: Manifest, n_stripes: int) -> list[int]:
    """Bytes of each stripe (chunk i travels down stripe i mod n)."""
    out = [0] * n_stripes
    for i, c in enumerate(manifest.chunks):
        out[i % n_stripes] += c.size
    return out


class UplinkMeter:
    """Measured relay uploads (bytes/s) by peer, from the reports of their plan children."""

    def __init__(self, keep_for: int = KEEP_FOR) -> None:
        self.keep_for = keep_for
        self.rate: dict[str, float] = {}
        self.at: dict[str, int] = {}  # publication of the last measurement

    def note(self, plan: BroadcastPlan, manifest: Manifest, done: Mapping[str, BroadcastDone], n_pub: int) -> None:
        """Fold one version's reports (``done``: member → its report) into the rates."""
        sizes = stripe_bytes(manifest, len(plan.stripes))
        parents = [s.parent_of() for s in plan.stripes]
        sent: dict[str, list[float]] = {}  # parent -> the rates its children timed
        for child, report in done.items():
            if not report.ok:
                continue
            seen: set[int] = set()
            for st in report.streams or ():
                parent = parents[st.stripe].get(child) if st.stripe < len(parents) else None
                if parent is None or parent == plan.learner or st.stripe in seen:
                    continue
                seen.add(st.stripe)
                sent.setdefault(parent, []).append(min(st.bytes, sizes[st.stripe]) / max(st.seconds, MIN_SECONDS))
        for parent, rates in sent.items():
            rate = min(len(rates) * statistics.median_low(rates), MAX_WEIGHT * WEIGHT_UNIT)
            old = self.rate.get(parent) if n_pub - self.at.get(parent, n_pub) < self.keep_for else None
            self.rate[parent] = rate if old is None else (old + rate) / 2
            self.at[parent] = n_pub
        for p in [p for p, t in self.at.items() if n_pub - t >= self.keep_for]:
            del self.rate[p], self.at[p]

    def weight(self, peer_id: str) -> int | None:
        """The plan weight of ``peer_id``: its measured upload, or None (not measured)."""
        rate = self.rate.get(peer_id)
        return None if rate is None else weight_of(rate)
