"""The learner's settings (``echorl learner``) and those it shares with ``echorl train-local``.

One pydantic model per role, built from sections so each field is defined once:
:class:`TrainingFields` (``rl/config.py``: task, model, batch shape, GRPO, checkpoints: both
roles), :class:`ServiceFields` (everything the network service reads, one section per component:
:class:`LeaseFields`, :class:`AdmissionFields`, :class:`ActivationFields`, :class:`RosterFields`,
:class:`PolicingFields`; each component receives the one config object typed as its section, so no
setting is copied), and the learner's own broadcast fields. Every tunable is a documented flag.
Fields whose default differs between roles (steps, staleness, evaluation period) are typed once
in ``rl/config.py`` as ``Annotated`` aliases. The command line is
made from these models by :mod:`echorl.common.config`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from echorl.common.config import Flag, PeerFields, Section
from echorl.protocol import limits
from echorl.rl.config import BatchFields, EvalPrompts, FullEvery, TrainingFields


class LeaseFields(BatchFields):
    """How the learner service hands out work and watches its members."""

    prompts_per_lease: int = Field(8, ge=1, le=limits.MAX_PROMPTS_PER_LEASE)
    """most prompts in one lease"""
    lease_timeout_s: Annotated[float, Flag("--lease-timeout")] = Field(30.0, gt=0.0, le=86_400.0)
    """seconds before an unanswered lease expires and its prompts are re-queued while the fleet's pace is
    not measured yet; once it is, a lease gets 4x what the fleet takes for it (at least --lease-min, at most
    20x this and the time until its version goes stale: learner/pace.py)"""
    liveness_after_s: float = Field(3.0, gt=0.0, le=3600.0)
    """ping a live peer not heard from for this long"""
    ping_timeout_s: float = Field(3.0, gt=0.0, le=3600.0)
    """a ping unanswered this long marks the peer dead"""
    heartbeat_s: float = Field(2.0, gt=0.0, le=3600.0)
    """period of the liveness sweep"""


class AdmissionFields(Section):
    """What one peer may hold and how its unanswered leases are answered (``learner/admission.py``)."""

    max_leases_per_peer: int = Field(2, ge=1, le=1024)
    """leases a peer may hold at once once it is proven (its last 3 leases answered in time, as the learner
    measured them; before: one)"""
    max_leases_per_ip: int = Field(16, ge=0, le=1_000_000)
    """leases the peers of one IP address (an IPv6 address by its /64) may hold at once, so identities from
    one host cannot hold the in-flight budget (0: no cap)"""
    lease_min_s: Annotated[float, Flag("--lease-min")] = Field(2.0, gt=0.0, le=86_400.0)
    """shortest lease deadline whatever the fleet's pace (a round trip and a scheduling hiccup); a result
    later than half of it and 2x the fleet's time counts against the peer like an expiry"""
    unmeasured_deadline_factor: float = Field(4.0, ge=1.0, le=1000.0)
    """a peer not measured yet gets at most this many lease timeouts for a lease, whatever it declares"""
    expiry_backoff_s: float = Field(2.0, ge=0.0, le=3600.0)
    """after the k-th lease in a row expired unanswered, the peer waits this x 2^(k-1) for the next"""
    expiry_backoff_max_s: float = Field(120.0, ge=0.0, le=86_400.0)
    """longest expiry back-off"""
    refuse_after_expiries: int = Field(6, ge=0, le=10**6)
    """leases in a row expired unanswered after which the peer is refused for the run (0: never)"""
    max_batch_share: float = Field(1.0, gt=0.0, le=1.0)
    """while other peers have groups buffered, one peer's buffered groups stay within this share of the
    buffer (at least this share of a training batch); groups beyond are not accepted (prompts re-queued,
    unpaid): a cheater that slips through the checks dilutes the honest signal, never crowds it out.
    No bound while no other peer has a group buffered. 1: off (the default: 0.5 re-queued 20 % of a
    3-node demo's honest groups, whose submissions arrive in bursts; docs/threat-model.md)"""
    apply_bytes_per_s: float = Field(100e6, gt=0.0, le=1e12)
    """slowest weight load a lease deadline allows for (bytes/s): a version published while a node works
    is loaded into its engine before the lease's next sample"""


class ActivationFields(Section):
    """Which joined nodes get leases (cost-aware activation, architecture §7, ``learner/activation.py``)."""

    activation: Literal["all", "cost"] = "all"
    """which nodes get leases: 'all' every joined node; 'cost' only the cheapest set (ascending price per
    unit of measured throughput) that meets the required throughput with a margin (activation_margin
    plus the observed node-loss rate); the rest are parked as standby (deferred, still receiving broadcasts)"""
    activation_margin: float = Field(0.25, ge=0.0, le=100.0)
    """base margin over the required throughput for cost-aware activation"""
    activation_interval_s: float = Field(2.0, gt=0.0, le=3600.0)
    """re-decide the active set this often; also the standby nodes' retry delay"""
    activation_loss_window_s: float = Field(300.0, gt=0.0, le=86_400.0)
    """node losses counted for the preemption margin over this window"""
    activation_hysteresis: float = Field(0.25, ge=0.0, le=100.0)
    """extra margin a decision must meet to park a node that is active now"""


class RosterFields(Section):
    """Who holds a membership slot and who is put in a broadcast plan (``learner/roster.py``)."""

    max_peers_per_ip: int = Field(32, ge=0, le=1_000_000)
    """joined peers per IP address (an IPv6 address counts by its /64), so fresh identities from one host
    cannot flood the membership (0: no cap); a join beyond it takes the slot of the address's member that
    worked least recently, if one is past idle_member_drop_s since its first join, holds no lease and is
    not a proven worker that answered in time within 600 s, else it is refused with peer_limit"""
    plan_newcomers: int = Field(16, ge=0, le=4096)
    """peers that have not had a rollout accepted yet put in one broadcast plan (the rest catch up);
    workers are always in it"""
    plan_max_members: int = Field(1024, ge=1, le=limits.MAX_PLAN_MEMBERS)
    """peers in one broadcast plan at most, workers with the most accepted groups first (the rest catch up);
    every member is sent the whole member list, so a version's announcements grow as N^2 (1,024 members:
    ~1024 x 250 KiB): raise it only with the paged announcement of issue 27"""
    idle_member_drop_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """a member that never had a rollout accepted (and holds no lease, is not standby) is dropped this
    long after its first join; it joins again if it is still there. Also a newcomer's time to prove itself
    before a join from its full address may take its slot"""
    dead_member_drop_s: float = Field(60.0, gt=0.0, le=86_400.0)
    """a member that never worked is dropped this long after it stopped answering pings"""


class PolicingFields(Section):
    """Spot checks of behaviour log-probs and what a mismatch costs a peer (``learner/policing.py``)."""

    spot_check_fraction: float = Field(0.1, ge=0.0, le=1.0)
    """fraction of submissions whose behaviour log-probs are recomputed with the claimed version's snapshot;
    a mismatch refuses the submission and flags the peer, whose submissions are then all checked (0: off)"""
    spot_check_tolerance_mean: float = Field(0.02, gt=0.0, le=100.0)
    """a spot check fails if the mean |Δ log-prob| exceeds this (float32 CPU actors agree to ~1e-5;
    bf16/fp16 GPU actors need looser values)"""
    spot_check_tolerance_max: float = Field(0.5, gt=0.0, le=1000.0)
    """a spot check fails if the largest |Δ log-prob| exceeds this"""
    spot_check_ban_after: int = Field(3, ge=0, le=10**6)
    """mismatches before a peer is refused leases (0: never)"""
    sampling_proofs: bool = True
    """seeded sampling: every lease carries a secret seed and a spot check replays the node's choices
    (a token that is not the seeded sample refuses the submission, `not_sampled`); off: leases carry
    no seed and only log-probs are checked. vLLM nodes need it off until their seeded processor is
    wired (actor/vllm_backend.py)"""


class ServiceFields(LeaseFields, AdmissionFields, ActivationFields, RosterFields, PolicingFields):
    """Everything the learner's network service reads: its components each receive this one
    object, typed as their own section (no copies)."""

    price_per_hour: float = Field(0.0, ge=0.0, le=1e6)
    """the learner's own price per hour: cost so far, per step and per 1,000 rollouts (learner/ledger.py)"""


class LearnerConfig(TrainingFields, ServiceFields, PeerFields):
    """``echorl learner``."""

    key: str = ""
    """key file (created if missing; default: DIR/learner.key with --checkpoint-dir, else a fresh key per run)"""
    addr_file: str = ""
    """write the bootstrap multiaddr here"""
    dht: bool = True
    """run the Kademlia DHT (--no-dht: nodes must bootstrap from the learner itself)"""
    eval_prompts: EvalPrompts = 1024
    full_every: FullEvery = 10
    fanout: int = Field(4, ge=1, le=64)
    """broadcast fanout (stripes)"""
    chunk_kib: int = Field(0, ge=0, le=limits.MAX_CHUNK_BYTES // 1024)
    """broadcast chunk size in KiB (0: per version, W/(16·fanout·depth) rounded to a power of two in
    64 KiB..1 MiB, which keeps the relay pipeline's fill under 1/16 of the transfer)"""
    plan_weights: bool = False
    """give relays child slots in proportion to their upload as their plan children timed it
    (docs/broadcast-notes.md: 6.4 x -> 1.2 x the bound for 10,000 simulated peers, 5-100 Mbit/s; in
    the namespace lab 3 of 4 runs 23 % faster, one 5 % slower, and the timings read fast uplinks
    high on a CPU-starved machine: off until measured where each process has a core)"""
    broadcast_timeout_s: float = Field(120.0, gt=0.0, le=86_400.0)
    """how long one publication may take"""
    fetch_mbps_per_peer: float = Field(400.0, ge=0.0, le=1e6)
    """download rate one joined peer gets for catch-up and chunk requests (Mbit/s, bursts of 64 MiB), apart
    from the broadcast streams; peers that did not join get nothing (0: no per-peer limit)"""
    tensorboard: str = ""
    """also log every metrics row to this TensorBoard directory (needs the 'track' extra)"""
