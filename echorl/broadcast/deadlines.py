"""Deadlines of the weight path that scale with the bytes moved and the bandwidth measured.

A fixed timeout is either far too long for a 2 MB toy (a dead peer is waited for minutes) or too
short for a 60 GB model (a healthy transfer is cut off). Every weight-path deadline (announce,
chunk stream, catch-up, version apply, the learner's wait for ``BroadcastDone``) is instead::

    deadline_s = base_s + bytes / max(floor_bps, measured_bps) × safety

``bytes`` is what the busiest link must carry: a version's payload times ``upload_copies(plan)``
(the copies the busiest uploader of the plan sends), a stripe's share, a chunk, a frame.
``measured_bps`` is this peer's own recent throughput (an exponentially weighted mean of the
versions it moved, ``BandwidthMeter``), so a fast swarm keeps short deadlines; ``floor_bps``
keeps one slow measurement from shrinking a deadline below what a slow but live volunteer link
needs, and bounds the deadline before anything was measured. See docs/architecture.md §5.1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from echorl.protocol.plan import BroadcastPlan

MB = 1_000_000
#: A hop of the announcement down the plan, before its bytes: a dial and handshake, and the plan's
#: verification and planning at the member (0.4 s of CPU at 10,000 members) on a loaded node.
FORWARD_BASE_S = 2.0


@dataclass
class BandwidthMeter:
    """Exponentially weighted mean of measured transfer rates (bytes/s); 0 until a sample."""

    weight: float = 0.3
    bps: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        """Record a transfer of ``nbytes`` that took ``seconds``; tiny ones say little and are skipped."""
        if nbytes < 64 * 1024 or seconds <= 0:
            return
        rate = nbytes / seconds
        self.bps = rate if self.bps <= 0 else (1 - self.weight) * self.bps + self.weight * rate


@dataclass
class Deadlines:
    """The deadline policy of one peer (learner or relay): ``base_s`` for the fixed costs
    (dial, handshake, verification of small things), ``floor_bps`` the slowest link waited for,
    ``safety`` the slack over the expected transfer time."""

    base_s: float = 10.0
    floor_bps: float = 1.0 * MB
    safety: float = 3.0
    meter: BandwidthMeter = field(default_factory=BandwidthMeter)

    def __post_init__(self) -> None:
        if not (self.base_s > 0 and self.floor_bps > 0 and self.safety >= 1):
            raise ValueError("deadlines need base_s > 0, floor_bps > 0 and safety >= 1")

    def for_bytes(self, nbytes: int, *, hops: int = 1) -> float:
        """Seconds allowed to move ``nbytes`` (plus ``base_s`` per hop on the path)."""
        return transfer_deadline(
            nbytes, self.meter.bps, base_s=self.base_s * max(1, hops), floor_bps=self.floor_bps, safety=self.safety
        )

    def for_forward(self, nbytes: int, copies: int) -> float:
        """Seconds one member may take to pass an announcement of ``nbytes`` on to ``copies``
        plan children (``broadcast/announcing.py``): at the floor rate, since what is timed is
        the member's uplink, not this peer's."""
        return transfer_deadline(
            nbytes * max(1, copies), 0.0, base_s=FORWARD_BASE_S, floor_bps=self.floor_bps, safety=self.safety
        )


def upload_copies(plan: BroadcastPlan) -> float:
    """Copies of the payload the busiest uploader of ``plan`` sends (its children summed over
    the stripes, each stripe 1/k of the payload): what one version costs the slowest link. About
    1 + 1/k for the striped plan, k for one k-ary tree, N for a star."""
    load: dict[str, int] = {}
    for stripe in plan.stripes:
        for parent, children in stripe.children.items():
            load[parent] = load.get(parent, 0) + len(children)
    return max(1.0, max(load.values(), default=1) / max(1, len(plan.stripes)))


def transfer_deadline(
    nbytes: int, measured_bps: float = 0.0, *, base_s: float = 10.0, floor_bps: float = 1.0 * MB, safety: float = 3.0
) -> float:
    """``base_s + nbytes / max(floor_bps, measured_bps) × safety`` (seconds)."""
    return base_s + max(0, nbytes) / max(floor_bps, measured_bps) * safety
