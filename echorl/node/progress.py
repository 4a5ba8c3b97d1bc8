"""``NodeState``: what one node process knows of its run (the pinned learner, the lease it holds,
its weights and environments) and what it has done (the counters of its metrics row, which
``--metrics-port`` and the sinks export; docs/metrics.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class NodeState:
    run_id: str
    learner: str = ""  # learner peer id (pinned: it signs the manifests)
    leases_done: int = 0
    current_lease: str = ""
    weights: Any = None  # NodeWeights
    allow_env: tuple[str, ...] = ()  # user environments (module:Class) this node agreed to run
    envs: dict[str, Any] = field(default_factory=dict)  # built environments by (spec, options)
    membership: Any = None  # Membership (our DHT server)
    receipts: Any = None  # ReceiptLog
    sinks: list[Any] = field(default_factory=list)
    groups_generated: int = 0
    tokens_generated: int = 0
    generate_seconds: float = 0.0
    groups_credited: int = 0
    receipts_kept: int = 0
    receipts_invalid: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # error code -> submissions refused
    instance: bytes = b""  # random per process: the learner refuses a second live process with our key
    last_contact: float = 0.0  # monotonic time the learner last answered
    ended: Any = None  # the learner's RunEnded, once the run is over

    def row(self) -> dict[str, Any]:
        """The node's metrics, computed here only (sinks just export them)."""
        return {
            "version": self.weights.version if self.weights is not None else -1,
            "leases_done": self.leases_done,
            "groups_generated": self.groups_generated,
            "tokens_generated": self.tokens_generated,
            "generate_seconds": self.generate_seconds,
            "groups_credited": self.groups_credited,
            "receipts": self.receipts_kept,
            "receipts_invalid": self.receipts_invalid,
            "submissions_rejected_by_reason": dict(self.rejected),
        }

    def publish(self) -> None:
        row = self.row()
        for sink in self.sinks:
            sink.write(row)
