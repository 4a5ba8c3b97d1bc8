"""The contribution ledger and the cost account of a run, kept by the learner.

Per node (its ``PeerAccount`` in the peer book, ``learner/peers.py``): accepted submissions,
groups and tokens (each one answered with a signed ``Receipt``) and rejected submissions by
reason (the ``ErrorCode`` a submission was refused with: a closed set, so the per-peer map is
bounded; at most ``MAX_PEERS`` peers are tracked, later ones are counted under
``peers_untracked`` only). The accounts and the receipt sequence are checkpointed, so a resumed
learner's per-node figures go on from where they were and equal the node's receipts. A peer proven
to cheat (``learner/policing.py``) has its receipts that no replay verified voided: their groups,
tokens and cost leave its accepted figures for the ``*_voided`` columns (``PeerAccount.void_unverified``);
its verified receipts stand. Cost: each
node's declared price × the seconds of its *accepted, paid* work (a lease's issue → result, at
most what the fleet takes for such a lease: ``Admission.on_result``), so joining and idling, or
answering slowly, costs the run nothing more; time joined and alive is kept beside it (``tick``);
plus the learner's own ``price_per_hour × wall time``; and an *estimate* of what the accepted rollouts
would have cost generated on the learner's hardware, from its measured generation rate (the
held-out evaluation's samples/s).

Everything here runs on the trio loop in O(peers), except signing a receipt (``issue``: one
Ed25519 signature, in a worker thread).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from echorl.learner.peers import MAX_ACCOUNTS, SECONDS_PER_HOUR, PeerAccount, PeerBook
from echorl.protocol import wire
from echorl.protocol.errors import ProtocolError
from echorl.protocol.identity import Identity, short_id
from echorl.protocol.messages import Message, Receipt

if TYPE_CHECKING:
    from echorl.actor.types import RolloutGroup
    from echorl.net.host import RequestContext

Handler = Callable[[Message, "RequestContext"], Awaitable[Message]]
MAX_PEERS = MAX_ACCOUNTS


class Ledger:
    """Receipts and cost over the peer book's accounts. ``price_per_hour``: the learner's own
    price; ``learner_rate()``: its measured generation rate in samples/s (0: unknown), read for
    the estimate of generating the accepted rollouts on the learner."""

    def __init__(
        self,
        identity: Identity,
        run_id: str,
        book: PeerBook | None = None,
        *,
        price_per_hour: float = 0.0,
        learner_rate: Callable[[], float] = lambda: 0.0,
        started: float | None = None,
    ) -> None:
        self.identity = identity
        self.run_id = run_id
        self.book = book if book is not None else PeerBook()
        self.price_per_hour = price_per_hour
        self.learner_rate = learner_rate
        self.started = time.monotonic() if started is None else started
        self.seq = 0  # receipts issued in this run (continues across a resume)
        self._last_tick: float | None = None

    @property
    def accounts(self) -> dict[str, PeerAccount]:
        """The kept accounts (the peer book's)."""
        return self.book.accounts

    def state_dict(self) -> dict[str, Any]:
        """The receipt sequence (the accounts are the peer book's part of the checkpoint)."""
        return {"receipts_issued": self.seq}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        seq = state.get("receipts_issued", 0)
        if isinstance(seq, int) and not isinstance(seq, bool) and seq >= 0:
            self.seq = seq

    def reject(self, peer_id: str, reason: str) -> None:
        self.book.account(peer_id).reject(reason)

    def accept(
        self,
        peer_id: str,
        lease_id: str,
        submitted: int,
        groups: int,
        tokens: int,
        behaviour_version: int,
        learner_version: int,
        credit: bool = True,
        verified: bool = False,
    ) -> Receipt:
        """The unsigned receipt of an accepted submission (sign with ``wire.sign``), with the
        next sequence number; the peer is credited unless ``credit`` is False (``issue`` credits
        once the receipt is signed)."""
        receipt = Receipt(
            run_id=self.run_id,
            learner_peer_id=self.identity.peer_id,
            peer_id=peer_id,
            lease_id=lease_id,
            seq=self.seq + 1,
            groups_submitted=submitted,
            groups=groups,
            tokens=tokens,
            behaviour_version=behaviour_version,
            learner_version=learner_version,
            issued_at=time.time(),
            verified=verified,
        )
        self.seq += 1
        if credit:
            self.book.account(peer_id).credit(submitted, groups, tokens, verified)
        return receipt

    async def issue(
        self,
        peer_id: str,
        lease_id: str,
        submitted: int,
        kept: list[RolloutGroup],
        behaviour_version: int,
        learner_version: int,
        verified: bool = False,
        work_s: float = 0.0,
    ) -> Receipt:
        """The signed receipt for the ``kept`` groups (signed in a worker thread); the peer is
        credited once it is signed, so credit and receipts stay equal if the learner stops here.
        ``verified``: the submission's sampling replay ran and held. ``work_s``: the seconds of
        work to bill, at the peer's declared price, for the kept share of the ``submitted``."""
        tokens = count_tokens(kept)
        receipt = self.accept(
            peer_id,
            lease_id,
            submitted,
            len(kept),
            tokens,
            behaviour_version,
            learner_version,
            credit=False,
            verified=verified,
        )
        signed: Receipt = await trio.to_thread.run_sync(wire.sign, receipt, self.identity)
        account = self.book.account(peer_id)
        account.credit(submitted, len(kept), tokens, verified)
        if kept and (peer := self.book.get(peer_id)) is not None:
            account.bill(work_s * len(kept) / max(1, submitted), float(peer.capability.price_per_hour), verified)
        return signed

    def counting(self, handler: Handler) -> Handler:
        """``handler`` with every refusal (a ``ProtocolError``) counted against the stream's
        authenticated remote peer, by error code."""

        async def counted(msg: Message, ctx: RequestContext) -> Message:
            try:
                return await handler(msg, ctx)
            except ProtocolError as exc:
                self.reject(ctx.peer_id, exc.code.value)
                raise

        return counted

    def tick(self, peers: list[tuple[str, bool]], now: float | None = None) -> None:
        """Integrate the time joined and alive since the last tick for every ``(peer_id, alive)``."""
        now = time.monotonic() if now is None else now
        dt = 0.0 if self._last_tick is None else max(0.0, now - self._last_tick)
        self._last_tick = now
        for peer_id, alive in peers:
            if alive:
                self.book.account(peer_id).alive_for(dt)

    def cost(self, steps: int, rollouts_accepted: int, group_size: int, now: float | None = None) -> dict[str, Any]:
        """Cost so far, per step and per 1,000 accepted rollout groups, learner vs nodes; and the
        estimate of generating the same rollouts on the learner (None while its rate is unknown)."""
        now = time.monotonic() if now is None else now
        learner = self.price_per_hour * max(0.0, now - self.started) / SECONDS_PER_HOUR
        nodes = sum(a.cost for a in self.accounts.values())
        total = learner + nodes
        rate = self.learner_rate()
        estimate = None
        if rate > 0:
            seconds = rollouts_accepted * group_size / rate
            estimate = self.price_per_hour * seconds / SECONDS_PER_HOUR
        return {
            "cost_learner": learner,
            "cost_nodes": nodes,
            "cost_total": total,
            "cost_per_step": total / steps if steps > 0 else None,
            "cost_per_1k_rollouts": 1000.0 * total / rollouts_accepted if rollouts_accepted > 0 else None,
            "cost_rollouts_on_learner_estimate": estimate,
            "learner_gen_samples_per_s": rate or None,
        }

    def metrics(self, steps: int, group_size: int) -> dict[str, Any]:
        """Receipts, rejections and cost so far; integrates the members' time up to now first."""
        self.tick([(p.peer_id, p.alive) for p in self.book.values()])
        accepted = sum(a.groups_accepted for a in self.accounts.values())
        return {**self.totals(), **self.cost(steps, accepted, group_size)}

    def peer_fields(self, peer_id: str) -> dict[str, Any]:
        """The ledger's columns of one peer in ``Status`` (flat scalars, reasons prefixed)."""
        acc = self.book.find_account(peer_id) or PeerAccount()
        out: dict[str, Any] = {
            "short_id": short_id(peer_id),
            "submissions_accepted": acc.submissions_accepted,
            "groups_accepted_total": acc.groups_accepted,
            "groups_dropped": acc.groups_dropped,
            "tokens_accepted": acc.tokens_accepted,
            "submissions_rejected": acc.rejected_total,
            "top_rejection": acc.top_rejection(),
            "joined_s": round(acc.joined_s, 1),
            "cost": round(acc.cost, 6),
            "submissions_voided": acc.submissions_voided,
            "groups_voided": acc.groups_voided,
            "cost_voided": round(acc.cost_voided, 6),
        }
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
        return {
            "receipts_issued": self.seq,
            "submissions_rejected_total": sum(a.rejected_total for a in accs),
            "peers_untracked": self.book.untracked,
        }

    def nodes_line(self) -> str:
        """Each kept account as ``<short id> <groups> groups/<rejected> rejected`` (the summary)."""
        return (
            ", ".join(
                f"{short_id(p)} {a.groups_accepted} groups/{a.rejected_total} rejected"
                for p, a in sorted(self.accounts.items())
            )
            or "none"
        )

    def row(self, steps: int, group_size: int) -> dict[str, Any]:
        """The ledger's part of a metrics row: ``metrics`` plus the labelled maps /metrics exports."""
        out = self.metrics(steps, group_size)
        out["cost_by_part"] = {"learner": out["cost_learner"], "nodes": out["cost_nodes"]}
        out["submissions_rejected_by_reason"] = self.rejections_by_reason()
        out["per_node_submissions_rejected"] = {short_id(p): a.rejected_total for p, a in self.accounts.items()}
        return out


def count_tokens(groups: list[RolloutGroup]) -> int:
    """Completion tokens of actor groups (``samples[i].token_ids``)."""
    return sum(len(s.token_ids) for g in groups for s in g.samples)


def carries_signal(group: RolloutGroup) -> bool:
    """Whether a group can teach anything by construction: a group of two or more samples that
    are all the same tokens (e.g. every completion one EOS) has zero advantage for every sample
    whatever the rewards, so it is not paid (docs/threat-model.md)."""
    return len(group.samples) < 2 or len({tuple(s.token_ids) for s in group.samples}) > 1
