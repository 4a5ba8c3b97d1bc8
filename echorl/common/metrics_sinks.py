"""Where a metrics row goes besides the JSONL file: Prometheus ``/metrics`` and TensorBoard.

One place computes a row (``TrainingLoop._row`` plus its rollout source's ``metrics()``, and the
node's ``NodeState.row``); these
are sinks only: ``write(row)`` keeps or logs it, nothing is recomputed. The Prometheus exporter
keeps the newest value of every documented key (a key missing from a row, like ``eval_reward``
between evaluations, keeps its last value) and builds the metric families at scrape time in
prometheus_client's own server thread (``start_http_server``), never on the trio loop. Names,
types and labels are a contract, documented in docs/metrics.md.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from typing import Any

# (row key, metric name, "gauge" | "counter", help). Counter names end in _total: the row holds
# the cumulative value, exported as is.
LEARNER_SCALARS: tuple[tuple[str, str, str, str], ...] = (
    ("step", "echorl_learner_step", "gauge", "optimizer steps done (= policy version trained)"),
    ("published_version", "echorl_learner_published_version", "gauge", "newest version handed to the broadcast"),
    ("reward_mean", "echorl_learner_reward_mean", "gauge", "mean task reward of the last training batch"),
    (
        "eval_reward",
        "echorl_learner_eval_reward",
        "gauge",
        "held-out reward, exact where the task can (last eval)",
    ),
    ("eval_reward_sampled", "echorl_learner_eval_reward_sampled", "gauge", "held-out reward of one sample per prompt"),
    (
        "exploitability",
        "echorl_learner_exploitability",
        "gauge",
        "chips/hand a best response gains over the game's value (poker; 0 at Nash)",
    ),
    (
        "opponent_exploitability",
        "echorl_learner_opponent_exploitability",
        "gauge",
        "exploitability of self-play's training opponent, the mean of the last K snapshots (poker)",
    ),
    (
        "forfeit_prob",
        "echorl_learner_forfeit_prob",
        "gauge",
        "mean probability of an illegal answer at the policy's decisions (poker)",
    ),
    ("loss", "echorl_learner_loss", "gauge", "GRPO loss of the last step"),
    ("grad_norm", "echorl_learner_grad_norm", "gauge", "gradient norm of the last step, before clipping"),
    ("entropy", "echorl_learner_entropy", "gauge", "mean per-token entropy (nats) of the policy on the last batch"),
    ("zero_var_group_frac", "echorl_learner_zero_var_group_frac", "gauge", "groups of the last batch with one reward"),
    ("clip_frac", "echorl_learner_clip_frac", "gauge", "completion tokens of the last batch whose ratio was clipped"),
    (
        "behaviour_mismatch",
        "echorl_learner_behaviour_mismatch",
        "gauge",
        "mean |log π_learner − log π_behaviour| (nats) over the last batch's completion tokens",
    ),
    ("busy_fraction", "echorl_learner_busy_fraction", "gauge", "training time / wall time"),
    ("elapsed_s", "echorl_learner_elapsed_seconds", "gauge", "seconds since training started"),
    ("rollouts_accepted", "echorl_rollouts_accepted_total", "counter", "rollout groups accepted into the buffer"),
    (
        "rollouts_rejected_stale",
        "echorl_rollouts_rejected_stale_total",
        "counter",
        "rollout groups refused for staleness (t - b > S)",
    ),
    (
        "rollouts_dropped_stale",
        "echorl_rollouts_dropped_stale_total",
        "counter",
        "accepted rollout groups that went stale before a batch took them "
        "(the buffer refuses at acceptance what its queue would let go stale)",
    ),
    ("rollouts_per_s", "echorl_rollouts_per_second", "gauge", "rollout groups trained per second (recent window)"),
    ("staleness_max", "echorl_staleness_max", "gauge", "largest t - b of any accepted group"),
    ("staleness_mean", "echorl_staleness_mean", "gauge", "mean t - b of accepted groups"),
    ("nodes_active", "echorl_nodes_active", "gauge", "nodes alive and heard from in the last 30 s"),
    ("nodes_standby", "echorl_nodes_standby", "gauge", "nodes parked by cost-aware activation"),
    (
        "required_rollouts_per_s",
        "echorl_required_rollouts_per_second",
        "gauge",
        "provisioning rule's required throughput",
    ),
    ("available_rollouts_per_s", "echorl_available_rollouts_per_second", "gauge", "Σ measured node throughput"),
    ("signatures_verified", "echorl_signatures_verified_total", "counter", "signed messages verified"),
    ("leases_issued", "echorl_leases_issued_total", "counter", "leases issued"),
    ("leases_expired", "echorl_leases_expired_total", "counter", "leases expired (prompts re-queued)"),
    ("receipts_issued", "echorl_receipts_issued_total", "counter", "signed receipts returned to nodes"),
    ("t_train_s", "echorl_train_step_seconds", "gauge", "EMA of one training step's seconds"),
    ("t_bcast_s", "echorl_broadcast_seconds_ema", "gauge", "EMA of one broadcast's seconds"),
    ("cost_per_step", "echorl_cost_per_step", "gauge", "cost so far / steps"),
    ("cost_per_1k_rollouts", "echorl_cost_per_1k_rollouts", "gauge", "cost so far per 1,000 accepted rollout groups"),
    (
        "cost_rollouts_on_learner_estimate",
        "echorl_cost_rollouts_on_learner_estimate",
        "gauge",
        "ESTIMATE: cost of generating the accepted rollouts on the learner at its price and measured rate",
    ),
    (
        "joins_refused_ip_cap",
        "echorl_joins_refused_ip_cap_total",
        "counter",
        "joins refused (peer_limit): the address already holds max_peers_per_ip members",
    ),
    (
        "newcomer_leases_earned",
        "echorl_newcomer_leases_earned_total",
        "counter",
        "leases added to the newcomer budget by unproven peers' answers in time after their first (for 60 s each)",
    ),
    (
        "newcomer_leases_lost",
        "echorl_newcomer_leases_lost_total",
        "counter",
        "earned newcomer leases taken back: two for each lease answered late or expired, by any peer",
    ),
    (
        "pings",
        "echorl_pings_total",
        "counter",
        "liveness pings sent to members not heard from lately (at most MAX_PINGS_PER_S a second at any N)",
    ),
    (
        "pings_excused",
        "echorl_pings_excused_total",
        "counter",
        "liveness pings that timed out while the learner's own loop ran late: the peer is not marked dead",
    ),
    (
        "loop_lag_p99_ms",
        "echorl_learner_loop_lag_p99_ms",
        "gauge",
        "99th percentile over the last minute of how late the learner's trio loop woke a 0.1 s sleep (ms)",
    ),
    (
        "members_displaced",
        "echorl_members_displaced_total",
        "counter",
        "members whose slot a newcomer of their full address took (past their grace, not a recent proven worker)",
    ),
    (
        "plan_newcomers_capped",
        "echorl_plan_newcomers_capped_total",
        "counter",
        "peers without accepted work left out of a broadcast plan (summed over plans)",
    ),
    (
        "members_dropped_idle",
        "echorl_members_dropped_idle_total",
        "counter",
        "members that never worked, dropped after idle_member_drop_s / dead_member_drop_s",
    ),
    (
        "connections_refused",
        "echorl_connections_refused_total",
        "counter",
        "inbound connections (libp2p and the direct chunk port) closed at once: the address or the total "
        "was at its cap",
    ),
    (
        "announce_sends",
        "echorl_announce_sends_total",
        "counter",
        "plan announcements the learner sent itself (the rest went down stripe 0 from member to member)",
    ),
    (
        "announce_heard",
        "echorl_announce_heard_total",
        "counter",
        "members that took a plan announcement from their stripe-0 parent and said so",
    ),
    (
        "announce_late",
        "echorl_announce_late_total",
        "counter",
        "members left to a stripe-0 parent that got the learner's copy at their deadline (the parent withheld it)",
    ),
    (
        "fetch_refused_unjoined",
        "echorl_fetch_refused_unjoined_total",
        "counter",
        "chunk / catch-up requests from peers that have not joined, refused unread",
    ),
    (
        "sampling_proofs_failed",
        "echorl_sampling_proofs_failed_total",
        "counter",
        "spot-checked submissions whose tokens were not the lease's seeded samples (not_sampled: the peer is flagged)",
    ),
    (
        "groups_over_batch_share",
        "echorl_groups_over_batch_share_total",
        "counter",
        "rollout groups re-queued unpaid: their peer or its address held max_batch_share of the buffer",
    ),
    (
        "receipts_voided",
        "echorl_receipts_voided_total",
        "counter",
        "receipts no replay had verified, voided when their peer was proven to cheat (groups and cost uncounted)",
    ),
    (
        "groups_purged",
        "echorl_groups_purged_total",
        "counter",
        "buffered groups of peers proven to cheat, dropped before any batch took them (prompts re-queued)",
    ),
    (
        "fetch_rate_limited",
        "echorl_fetch_rate_limited_total",
        "counter",
        "chunk requests refused: the peer's download rate (fetch_mbps_per_peer) would make it wait too long",
    ),
)
# (row key holding {label value: number}, metric name, kind, label name, help)
LEARNER_LABELLED: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "submissions_rejected_by_reason",
        "echorl_submissions_rejected_total",
        "counter",
        "reason",
        "submissions refused, by error code",
    ),
    (
        "broadcast_seconds_by_kind",
        "echorl_broadcast_seconds",
        "gauge",
        "kind",
        "seconds of the newest completed broadcast of each kind (full, delta)",
    ),
    ("cost_by_part", "echorl_cost_total", "counter", "part", "cost so far (price x time), learner vs nodes"),
    (
        "per_node_groups",
        "echorl_node_groups_accepted_total",
        "counter",
        "peer",
        "rollout groups accepted and paid per node (a group whose samples all agree carries no signal and is not paid)",
    ),
    (
        "per_node_groups_generated",
        "echorl_node_groups_generated_total",
        "counter",
        "peer",
        "rollout groups of each node's accepted submissions, paid or not",
    ),
    ("per_node_rollouts_per_s", "echorl_node_rollouts_per_second", "gauge", "peer", "measured throughput per node"),
)
NODE_SCALARS: tuple[tuple[str, str, str, str], ...] = (
    ("version", "echorl_node_version", "gauge", "newest verified policy version held"),
    ("leases_done", "echorl_node_leases_done_total", "counter", "leases answered"),
    ("groups_generated", "echorl_node_groups_generated_total", "counter", "rollout groups generated and submitted"),
    ("tokens_generated", "echorl_node_tokens_generated_total", "counter", "completion tokens generated"),
    ("generate_seconds", "echorl_node_generate_seconds_total", "counter", "seconds spent generating"),
    ("groups_credited", "echorl_node_groups_credited_total", "counter", "groups credited by verified receipts"),
    ("receipts", "echorl_node_receipts_total", "counter", "verified receipts stored"),
    ("receipts_invalid", "echorl_node_receipts_invalid_total", "counter", "receipts that failed verification"),
)
NODE_LABELLED: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "submissions_rejected_by_reason",
        "echorl_node_submissions_rejected_total",
        "counter",
        "reason",
        "submissions the learner refused, by error code",
    ),
)

# ``echorl serve --metrics-port``: totals since start (sessions that ended included), and each live
# session's and each user's usage (echorl/service/accounting.py builds the row)
SERVE_SCALARS: tuple[tuple[str, str, str, str], ...] = (
    ("sessions_live", "echorl_serve_sessions", "gauge", "sessions open now"),
    ("requests", "echorl_serve_requests_total", "counter", "training and sampling requests completed"),
    ("tokens_sampled", "echorl_serve_tokens_sampled_total", "counter", "tokens sampled"),
    (
        "tokens_sampled_by_nodes",
        "echorl_serve_tokens_sampled_by_nodes_total",
        "counter",
        "of those, tokens sampled by swarm nodes (--swarm)",
    ),
    ("tokens_trained", "echorl_serve_tokens_trained_total", "counter", "tokens through forward_backward"),
    ("tokens_forward", "echorl_serve_tokens_forward_total", "counter", "tokens through forward (no gradient)"),
    ("compute_s", "echorl_serve_compute_seconds_total", "counter", "seconds the worker spent on requests"),
    ("cost", "echorl_serve_cost_total", "counter", "compute seconds priced per hour (--price-per-hour)"),
)
SERVE_USAGE_KEYS = (
    "requests",
    "tokens_sampled",
    "tokens_sampled_by_nodes",
    "tokens_trained",
    "tokens_forward",
    "compute_s",
    "cost",
)
"""Each is also exported per live session (``session_<key>``, label ``session``) and per user
(``user_<key>``, label ``user``)."""
SERVE_LABELLED: tuple[tuple[str, str, str, str, str], ...] = tuple(
    (f"{by}_{key}", name.replace("echorl_serve_", f"echorl_serve_{by}_"), kind, by, f"{doc}, by {by}")
    for by in ("session", "user")
    for key, name, kind, doc in SERVE_SCALARS
    if key in SERVE_USAGE_KEYS
)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


class RowCollector:
    """A prometheus_client collector over the newest row (swapped whole: no lock on read).
    ``merge_maps``: a labelled map adds to the labels seen before (a node's counts stay after it
    leaves); off, a map replaces the last (the serve's live sessions: a label per ended session
    would grow without bound)."""

    def __init__(self, scalars: tuple, labelled: tuple, merge_maps: bool = True) -> None:
        self.scalars, self.labelled, self.merge_maps = scalars, labelled, merge_maps
        self._state: dict[str, Any] = {}
        self._lock = threading.Lock()  # writers only (the loop thread); readers see a whole dict

    def write(self, row: dict[str, Any]) -> None:
        with self._lock:
            state = dict(self._state)
            for key, value in row.items():
                if self.merge_maps and isinstance(value, dict) and isinstance(state.get(key), dict):
                    state[key] = {**state[key], **value}
                elif value is not None:
                    state[key] = value
            self._state = state

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        state = self._state
        for key, name, kind, doc in self.scalars:
            value = _number(state.get(key))
            if value is None:
                continue
            if kind == "counter":
                yield CounterMetricFamily(name.removesuffix("_total"), doc, value=value)
            else:
                yield GaugeMetricFamily(name, doc, value=value)
        for key, name, kind, label, doc in self.labelled:
            values = state.get(key)
            if not isinstance(values, dict):
                continue
            fam = (
                CounterMetricFamily(name.removesuffix("_total"), doc, labels=[label])
                if kind == "counter"
                else GaugeMetricFamily(name, doc, labels=[label])
            )
            for lv, v in sorted(values.items()):
                if (num := _number(v)) is not None:
                    fam.add_metric([str(lv)[:64]], num)
            yield fam


def parse_listen(spec: str) -> tuple[str, int]:
    """``PORT`` (on 127.0.0.1) or ``HOST:PORT`` → (host, port); ValueError on anything else."""
    host, _, port = spec.rpartition(":")
    try:
        n = int(port)
    except ValueError:
        raise ValueError(f"--metrics-port {spec!r}: expected PORT or HOST:PORT") from None
    if not 0 <= n <= 65535:
        raise ValueError(f"--metrics-port {spec!r}: port out of range")
    return host or "127.0.0.1", n


def sink_flags_error(metrics_port: str = "", tensorboard: str = "") -> str | None:
    """What is wrong with a role's sink flags (checked before anything starts), or None."""
    try:
        if metrics_port:
            parse_listen(metrics_port)
    except ValueError as exc:
        return str(exc)
    return tensorboard_missing() if tensorboard else None


class PrometheusSink:
    """Serves ``/metrics`` from its own registry in a daemon thread (``start_http_server``)."""

    def __init__(self, role: str, listen: str) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        tables = {"node": (NODE_SCALARS, NODE_LABELLED), "serve": (SERVE_SCALARS, SERVE_LABELLED)}
        scalars, labelled = tables.get(role, (LEARNER_SCALARS, LEARNER_LABELLED))
        self.collector = RowCollector(scalars, labelled, merge_maps=role != "serve")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        addr, port = parse_listen(listen)
        self.server, self.thread = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self.server.server_port

    def write(self, row: dict[str, Any]) -> None:
        self.collector.write(row)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class TensorBoardSink:
    """Every numeric value of a row as a TensorBoard scalar at ``row["step"]``; a dict of numbers
    becomes ``key/label`` scalars. The writer flushes from its own thread."""

    def __init__(self, logdir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=logdir)
        self.n = 0

    def write(self, row: dict[str, Any]) -> None:
        self.n += 1
        step = int(row.get("step", self.n))
        for key, value in row.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    if (num := _number(v)) is not None:
                        self.writer.add_scalar(f"{key}/{sub}", num, step)
            elif (num := _number(value)) is not None and key != "step":
                self.writer.add_scalar(key, num, step)

    def close(self) -> None:
        self.writer.close()


def tensorboard_missing() -> str | None:
    """None if TensorBoard logging works here, else the one-line hint to install the extra."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return "--tensorboard needs the 'track' extra: pip install 'echorl[track]'"
    return None


def open_sinks(role: str, metrics_port: str = "", tensorboard: str = "") -> list[Any]:
    """The sinks a role's flags ask for (raises OSError if the port is taken)."""
    sinks: list[Any] = []
    if metrics_port:
        sinks.append(PrometheusSink(role, metrics_port))
    if tensorboard:
        sinks.append(TensorBoardSink(tensorboard))
    return sinks
