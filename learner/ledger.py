"""The contribution ledger and the cost account of a run, kept by the learner.

Per node: accepted submissions, groups and tokens (each one answered with a signed ``Receipt``)
and rejected submissions by reason (the ``ErrorCode`` a submission was refused with: a closed
set, so the per-peer map is bounded; at most ``MAX_PEERS`` peers are tracked, later ones are
counted under ``peers_untracked`` only). Cost: ``price × time`` integrated over each node's time
joined and alive (``tick``), plus the learner's own ``price_per_hour × wall time``; and an
*estimate* of what the accepted rollouts would have cost generated on the learner's hardware,
from its measured generation rate (the held-out evaluation's samples/s).

Everything here runs on the trio loop in O(peers), except signing a receipt (``issue``: one
Ed25519 signature, in a worker thread).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from echorl.protocol import wire
from echorl.protocol.errors import ProtocolError
from echorl.protocol.identity import Identity, short_id
from echorl.protocol.messages import Receipt

Handler = Callable[[Any, Any], Awaitable[Any]]
MAX_PEERS = 4096
SECONDS_PER_HOUR = 3600.0


@dataclass
class PeerAccount:
    submissions_accepted: int = 0
    groups_accepted: int = 0
    groups_dropped: int = 0  # submitted in an accepted submission but refused by the buffer
    tokens_accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> submissions
    joined_s: float = 0.0  # time joined and alive
    cost: float = 0.0  # Σ price × time joined

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def top_rejection(self) -> str | None:
        return max(self.rejected, key=lambda k: self.rejected[k]) if self.rejected else None


@dataclass
class Ledger:
    identity: Identity
    run_id: str
    price_per_hour: float = 0.0  # the learner's own price
    started: float = field(default_factory=time.monotonic)
    accounts: dict[str, PeerAccount] = field(default_factory=dict)
    seq: int = 0
    peers_untracked: int = 0
    gen_samples_per_s: float = 0.0  # the learner's own measured generation rate (0: unknown)
    _last_tick: float | None = None

    def account(self, peer_id: str) -> PeerAccount | None:
        acc = self.accounts.get(peer_id)
        if acc is None:
            if len(self.accounts) >= MAX_PEERS:
                self.peers_untracked += 1
                return None
            acc = self.accounts[peer_id] = PeerAccount()
        return acc

    def reject(self, peer_id: str, reason: str) -> None:
        acc = self.account(peer_id)
        if acc is not None:
            acc.rejected[reason] = acc.rejected.get(reason, 0) + 1

    def accept(self, peer_id: str, lease_id: str, submitted: int, groups: int, tokens: int,
               behaviour_version: int, learner_version: int) -> Receipt:
        """Count an accepted submission; the unsigned receipt for it (sign with ``sign``)."""
        acc = self.account(peer_id)
        if acc is not None:
            acc.submissions_accepted += 1
            acc.groups_accepted += groups
            acc.groups_dropped += submitted - groups
            acc.tokens_accepted += tokens
        self.seq += 1
        return Receipt(run_id=self.run_id, learner_peer_id=self.identity.peer_id, peer_id=peer_id, lease_id=lease_id,
                       seq=self.seq, groups_submitted=submitted, groups=groups, tokens=tokens,
                       behaviour_version=behaviour_version, learner_version=learner_version, issued_at=time.time())

    async def issue(self, peer_id: str, lease_id: str, submitted: int, kept: list[Any], behaviour_version: int,
                    learner_version: int) -> Receipt:
        """``accept`` the ``kept`` groups and sign the receipt (in a worker thread)."""
        receipt = self.accept(peer_id, lease_id, submitted, len(kept), count_tokens(kept), behaviour_version,
                              learner_version)
        return await trio.to_thread.run_sync(wire.sign, receipt, self.identity)

    def counting(self, handler: Handler) -> Handler:
        """``handler`` with every refusal (a ``ProtocolError``) counted against the stream's
        authenticated remote peer, by error code."""

        async def counted(msg: Any, ctx: Any) -> Any:
            try:
                return await handler(msg, ctx)
            except ProtocolError as exc:
                self.reject(ctx.peer_id, exc.code.value)
                raise

        return counted

    def tick(self, peers: list[tuple[str, float, bool]], now: float | None = None) -> None:
        """Integrate price × time since the last tick for every ``(peer_id, price, alive)``."""
        now = time.monotonic() if now is None else now
        dt = 0.0 if self._last_tick is None else max(0.0, now - self._last_tick)
        self._last_tick = now
        for peer_id, price, alive in peers:
            acc = self.account(peer_id)
            if acc is not None and alive:
                acc.joined_s += dt
                acc.cost += max(0.0, price) * dt / SECONDS_PER_HOUR

    def cost(self, steps: int, rollouts_accepted: int, group_size: int, now: float | None = None) -> dict[str, Any]:
        """Cost so far, per step and per 1,000 accepted rollout groups, learner vs nodes; and the
        estimate of generating the same rollouts on the learner (None while its rate is unknown)."""
        now = time.monotonic() if now is None else now
        learner = self.price_per_hour * max(0.0, now - self.started) / SECONDS_PER_HOUR
        nodes = sum(a.cost for a in self.accounts.values())
        total = learner + nodes
        estimate = None
        if self.gen_samples_per_s > 0:
            seconds = rollouts_accepted * group_size / self.gen_samples_per_s
            estimate = self.price_per_hour * seconds / SECONDS_PER_HOUR
        return {"cost_learner": learner, "cost_nodes": nodes, "cost_total": total,
                "cost_per_step": total / steps if steps > 0 else None,
                "cost_per_1k_rollouts": 1000.0 * total / rollouts_accepted if rollouts_accepted > 0 else None,
                "cost_rollouts_on_learner_estimate": estimate,
                "learner_gen_samples_per_s": self.gen_samples_per_s or None}

    def metrics(self, peers: Any, steps: int, group_size: int) -> dict[str, Any]:
        """Receipts, rejections and cost so far; integrates the joined ``peers`` (the service's
        ``PeerRecord``s) up to now first."""
        self.tick([(p.peer_id, float(p.capability.price_per_hour), p.alive) for p in peers])
        accepted = sum(a.groups_accepted for a in self.accounts.values())
        return {**self.totals(), **self.cost(steps, accepted, group_size)}

    def peer_fields(self, peer_id: str) -> dict[str, Any]:
        """The ledger's columns of one peer in ``Status`` (flat scalars, reasons prefixed)."""
        acc = self.accounts.get(peer_id) or PeerAccount()
        out: dict[str, Any] = {"short_id": short_id(peer_id), "submissions_accepted": acc.submissions_accepted,
                               "groups_accepted_total": acc.groups_accepted, "groups_dropped": acc.groups_dropped,
                               "tokens_accepted": acc.tokens_accepted, "submissions_rejected": acc.rejected_total,
                               "top_rejection": acc.top_rejection(), "joined_s": round(acc.joined_s, 1),
                               "cost": round(acc.cost, 6)}
        out.update({f"rejected_{k}": v for k, v in sorted(acc.rejected.items())})
        return out

    def rejections_by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for acc in self.accounts.values():
            for reason, n in acc.rejected.items():
                out[reason] = out.get(reason, 0) + n
        return out

    def totals(self) -> dict[str, int]:
        accs = self.accounts.values()
        return {"receipts_issued": self.seq, "submissions_rejected_total": sum(a.rejected_total for a in accs),
                "peers_untracked": self.peers_untracked}


def count_tokens(groups: list[Any]) -> int:
    """Completion tokens of actor groups (``samples[i].token_ids``)."""
    return sum(len(s.token_ids) for g in groups for s in g.samples)
