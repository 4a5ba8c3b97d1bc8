"""Cost-aware activation (architecture §7): which joined nodes get leases and which wait as standby.

The overlap capacity model says the learner never waits when Σμ_i ≥ κR / (κ·T_train − T_bcast).
Leasing work to more nodes than that buys nothing but cost, so with ``--activation cost`` the
learner keeps only the cheapest set of nodes that meets the rule, with a margin for the observed
preemption rate, active; the rest are parked as *standby*: their lease requests are answered
``lease_deferred`` with reason ``standby``, but they still receive every broadcast, so they stay
warm (current weights) and can be activated at once when an active node is lost.

``choose_active`` is pure (no I/O, no clock, no network): it decides from a snapshot of offers.
:class:`Activator` is the learner's component that holds the current decision and the recent
node losses: the service's maintenance calls :meth:`Activator.reactivate` every
``activation_interval_s`` and :meth:`Activator.lost` when an active node dies.

Decisions:
- *Throughput* is what the learner measured itself (lease issue → accepted result, recent
  leases: ``PeerLoad.recent_per_s``), never the node's own ``generate_seconds``: a node that
  claims 0 s is ranked by how fast its accepted work really came back. The declared price is a
  bid (bounded by the wire schema, 0..1e9 per hour); it cannot buy throughput.
- *Cheapest* means ascending price per unit throughput, ``price_per_hour / rollouts_per_s``;
  ties (equal unit prices, e.g. every node free) go to the faster node, then by peer id, so the
  decision is deterministic.
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

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from echorl.learner.config import ActivationFields
from echorl.learner.peers import ACTIVE_WINDOW_S, PeerBook

log = logging.getLogger(__name__)


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


def _sort_key(offer: NodeOffer) -> tuple[int, float, float, str]:
    measured = offer.measured and offer.rollouts_per_s > 0
    # measured nodes first by unit price, the faster first; unmeasured ones after, by asking
    # price; then peer id
    price = unit_price(offer) if measured else offer.price_per_hour
    return (0 if measured else 1, price, -offer.rollouts_per_s, offer.peer_id)


def choose_active(nodes: list[NodeOffer], required_per_s: float | None, margin: float) -> Activation:
    """The cheapest prefix of ``nodes`` (ascending price per unit throughput) whose measured
    Σμ ≥ ``required_per_s`` × (1 + ``margin``); the others are standby. Everyone is active when
    the requirement is None/unknown/non-positive-or-NaN, when nothing is measured yet, or when
    even all measured nodes fall short. Never fewer than one active node (if any are offered)."""
    ids = {n.peer_id for n in nodes}
    measured = [n for n in nodes if n.measured and n.rollouts_per_s > 0]
    total = sum(n.rollouts_per_s for n in measured)
    if required_per_s is None or not math.isfinite(required_per_s) or required_per_s <= 0 or not measured:
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


class Activator:
    """The current activation decision over the peer book's live members (``None``: everyone is
    active), the recent losses behind its margin, and when it was last made. ``required()`` is
    the provisioning rule's Σμ (None: unbounded or unknown). A no-op unless
    ``activation == "cost"``."""

    def __init__(
        self, book: PeerBook, policy: ActivationFields, required: Callable[[], float | None] = lambda: None
    ) -> None:
        self.book = book
        self.policy = policy
        self.required = required
        self.decision: Activation | None = None
        self.losses: deque[tuple[float, str]] = deque()  # (monotonic time, peer id) of liveness expiries
        self.last_decision = 0.0

    @property
    def on(self) -> bool:
        return self.policy.activation == "cost"

    def is_standby(self, peer_id: str) -> bool:
        """True if the current decision parks this peer (only with ``activation == "cost"``)."""
        return self.on and self.decision is not None and peer_id in self.decision.standby

    def due(self, now: float) -> bool:
        """Whether the periodic re-decision is due."""
        return self.on and now - self.last_decision >= self.policy.activation_interval_s

    def metrics(self) -> dict[str, object]:
        """``activation``, ``nodes_standby`` and ``activation_target_per_s`` for metrics/status."""
        act = self.decision if self.on else None
        return {
            "activation": self.policy.activation,
            "nodes_standby": len(act.standby) if act else 0,
            "activation_target_per_s": act.target_per_s if act else None,
        }

    def reactivate(self, now: float | None = None) -> Activation | None:
        """Re-make the decision from the live members' prices and learner-measured throughput and the
        current required throughput; a no-op (None) unless ``activation == "cost"``."""
        pol = self.policy
        if not self.on:
            return None
        now = time.monotonic() if now is None else now
        while self.losses and now - self.losses[0][0] > pol.activation_loss_window_s:
            self.losses.popleft()
        live = self.book.active(ACTIVE_WINDOW_S)
        rates = {p.peer_id: self.book.measured_rate(p.peer_id) for p in live}  # the learner's own clock
        offers = [
            NodeOffer(p.peer_id, float(p.capability.price_per_hour), rates[p.peer_id], rates[p.peer_id] > 0)
            for p in live
        ]
        seen = {p.peer_id for p in self.book.active(pol.activation_loss_window_s)} | {pid for _, pid in self.losses}
        margin = preemption_margin(len(self.losses), len(seen), pol.activation_margin)
        try:
            required = self.required()
        except Exception:  # a broken estimate must not stop the learner: everyone works
            log.exception("required throughput unavailable; all nodes active")
            required = None
        before = self.decision
        decision = choose_active(offers, required, margin)
        if before is not None and decision.standby & before.active:
            # hysteresis: park an active node only if the cheaper set also meets a larger target,
            # so a requirement hovering around one node's throughput does not flap the set
            # (a larger target picks a longer prefix of the same order: a superset of active nodes)
            decision = choose_active(offers, required, margin + pol.activation_hysteresis)
        self.decision = decision
        self.last_decision = now
        changed = (
            bool(offers) if before is None else (before.active, before.standby) != (decision.active, decision.standby)
        )
        if changed:
            log.info(
                "activation: %d active, %d standby (target %s/s, margin %.2f)",
                len(decision.active),
                len(decision.standby),
                "-" if decision.target_per_s is None else f"{decision.target_per_s:.2f}",
                margin,
            )
        return decision

    def lost(self, peer_id: str) -> None:
        """A peer failed its liveness probe: count the loss; re-decide at once if it was active."""
        self.losses.append((time.monotonic(), peer_id))
        if self.on and not self.is_standby(peer_id):
            self.reactivate()
