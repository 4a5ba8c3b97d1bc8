"""Cost-aware activation (architecture §7): which joined nodes get leases and which wait as standby.

The overlap capacity model says the learner never waits when Σμ_i ≥ κR / (κ·T_train − T_bcast).
Leasing work to more nodes than that buys nothing but cost, so with ``--activation cost`` the
learner keeps only the cheapest set of nodes that meets the rule, with a margin for the observed
preemption rate, active; the rest are parked as *standby*: their lease requests are answered
``lease_deferred`` with reason ``standby``, but they still receive every broadcast, so they stay
warm (current weights) and can be activated at once when an active node is lost.

This module is pure (no I/O, no clock, no network): ``choose_active`` decides from a snapshot of
offers; the learner (``learner/service.py``) calls it every few seconds and at once when an
active node dies.

Decisions:
- *Cheapest* means ascending price per unit throughput, ``price_per_hour / rollouts_per_s``;
  ties (and equal prices) are broken by peer id, so the decision is deterministic.
- *Unmeasured* nodes (no rollout throughput measured yet) go last, cheapest price first: their
  throughput is unknown, so counting them towards the requirement could leave the learner
  short. A node that joins between decisions is leased work until the next decision (it is in
  neither set), which usually gives it a first measurement.
- If the requirement is unbounded (``None``: T_bcast ≥ κ·T_train, no node set keeps up) or
  not known yet, or no node is measured yet, or even all measured nodes together fall short of
  the target, every node is active: cost-awareness never starves the learner.
- At least one node is always active.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeOffer:
    """One live node as the activation policy sees it: its asking price (capability record),
    its measured rollout-group throughput μ_i and whether that measurement exists yet."""

    peer_id: str
    price_per_hour: float
    rollouts_per_s: float
    measured: bool


@dataclass
class Activation:
    """A decision: ``active`` nodes are leased work, ``standby`` nodes are deferred (but kept
    warm). ``available_per_s`` is Σμ of the measured active nodes; ``target_per_s`` is the
    requirement with its margin (None when everyone is active because the requirement is
    unbounded or unknown)."""

    active: set[str] = field(default_factory=set)
    standby: set[str] = field(default_factory=set)
    available_per_s: float = 0.0
    target_per_s: float | None = None


def unit_price(offer: NodeOffer) -> float:
    """Price per unit throughput (per rollout group per second); +inf when unmeasured."""
    if not offer.measured or offer.rollouts_per_s <= 0:
        return math.inf
    return offer.price_per_hour / offer.rollouts_per_s


def _sort_key(offer: NodeOffer) -> tuple[int, float, str]:
    measured = offer.measured and offer.rollouts_per_s > 0
    # measured nodes first by unit price; unmeasured ones after, by asking price; then peer id
    return (0 if measured else 1, unit_price(offer) if measured else offer.price_per_hour, offer.peer_id)


def choose_active(nodes: list[NodeOffer], required_per_s: float | None, margin: float) -> Activation:
    """The cheapest prefix of ``nodes`` (ascending price per unit throughput) whose measured
    Σμ ≥ ``required_per_s`` × (1 + ``margin``); the others are standby. Everyone is active when
    the requirement is None/unknown/non-positive-or-NaN, when nothing is measured yet, or when
    even all measured nodes fall short. Never fewer than one active node (if any are offered)."""
    ids = {n.peer_id for n in nodes}
    measured = [n for n in nodes if n.measured and n.rollouts_per_s > 0]
    total = sum(n.rollouts_per_s for n in measured)
    if (required_per_s is None or not math.isfinite(required_per_s) or required_per_s <= 0 or not measured):
        return Activation(active=ids, standby=set(), available_per_s=total, target_per_s=None)
    target = required_per_s * (1.0 + max(0.0, margin))
    if total < target:
        return Activation(active=ids, standby=set(), available_per_s=total, target_per_s=target)
    active: set[str] = set()
    got = 0.0
    for offer in sorted(nodes, key=_sort_key):
        if active and got >= target:
            break
        active.add(offer.peer_id)
        if offer.measured and offer.rollouts_per_s > 0:
            got += offer.rollouts_per_s
    return Activation(active=active, standby=ids - active, available_per_s=got, target_per_s=target)


def preemption_margin(lost_in_window: int, active_in_window: int, base: float) -> float:
    """Margin over the requirement: ``base`` plus the fraction of nodes lost (liveness expiry,
    e.g. preempted spot instances) among those active in the recent window, capped at 1. The
    more nodes disappear, the more spare throughput is kept active so a loss does not stall the
    learner until the next decision."""
    if active_in_window <= 0 or lost_in_window <= 0:
        return base
    return base + min(1.0, lost_in_window / active_in_window)
