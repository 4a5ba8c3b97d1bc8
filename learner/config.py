"""The learner's settings (``echorl learner``) and those it shares with ``echorl train-local``.

One pydantic model per role, built from sections so each field is defined once:
:class:`TrainingFields` (task, model, batch shape, GRPO, checkpoints: both roles),
:class:`LeaseFields` (what the network service reads; ``LeasePolicy`` in ``leases.py`` is this
section plus the sampling spec, built from a :class:`LearnerConfig` by field name), and the
learner's own broadcast / spot-check fields. Fields whose default differs between roles (steps,
staleness, evaluation period) are typed once here as ``Annotated`` aliases. The command line is
made from these models by :mod:`echorl.config`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from echorl.config import Flag, ModelFields, PeerFields, Section
from echorl.protocol import limits
from echorl.tasks import parse_task_options

Steps = Annotated[int, Field(ge=0, le=10**9, description="optimizer steps (versions) to train; the learner "
                                                          "runs until stopped with 0")]
Staleness = Annotated[int, Field(ge=0, le=10_000, description="staleness bound S: a rollout of version b is used "
                                                               "at step t iff t - b <= S")]
PublishEvery = Annotated[int, Field(ge=0, le=10**6, description="publication period κ in steps (0: max(1, S-1))")]
FullEvery = Annotated[int, Field(ge=1, le=10**6, description="a full snapshot every this many publications, "
                                                              "deltas between")]
EvalEvery = Annotated[int, Field(ge=1, le=10**9, description="held-out evaluation period in steps (and at the end)")]
TaskOptions = Annotated[dict[str, int | float | bool | str],
                        Flag("--task-option", parse=parse_task_options)]


class TaskFields(Section):
    """Which task prompts come from."""

    task: str = Field("addition", min_length=1)
    """built-in task name (addition, math, reasoning-gym) or package.module:Class"""
    task_options: TaskOptions = {}
    """task constructor option (the addition task's seed follows --seed)"""


class BatchFields(Section):
    """The shape of a step: what the buffer, the trainer and the lease service agree on."""

    staleness: Staleness = 4
    group_size: int = Field(8, ge=2, le=limits.MAX_GROUP_SIZE)
    """G samples per prompt"""
    prompts_per_step: int = Field(16, ge=1, le=100_000)
    """accepted groups per optimizer step (B)"""


class TrainingFields(ModelFields, TaskFields, BatchFields):
    """Everything a GRPO run needs, with or without a network."""

    steps: Steps = 0
    publish_every: PublishEvery = 0
    lr: float = Field(5e-4, ge=0.0, le=1.0)
    """AdamW learning rate (0 leaves the weights untouched)"""
    clip: float = Field(0.2, ge=0.0, le=10.0)
    """PPO clip epsilon"""
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    """sampling temperature"""
    eval_every: EvalEvery = 10
    metrics_out: str = ""
    """JSON-lines metrics file, one line per learner step"""
    checkpoint_dir: str = ""
    """where to write checkpoints (echorl learner: default runs/<run id>-<time>/checkpoints; 'none': none)"""
    checkpoint_every: int = Field(0, ge=0, le=10**9)
    """checkpoint period in steps (0: only at the end, and on SIGTERM for the learner)"""
    resume: bool = False
    """continue from the newest checkpoint in --checkpoint-dir"""
    nproc: int = Field(1, ge=1, le=256)
    """learner processes training each step data-parallel (torch.distributed: gloo on cpu, nccl with one
    GPU per rank); this process is rank 0 and alone runs everything else"""


class LeaseFields(BatchFields):
    """How the learner service hands out work (``LeasePolicy`` is a copy of this section)."""

    prompts_per_lease: int = Field(8, ge=1, le=limits.MAX_PROMPTS_PER_LEASE)
    """most prompts in one lease"""
    lease_timeout_s: Annotated[float, Flag("--lease-timeout")] = Field(30.0, gt=0.0, le=86_400.0)
    """seconds before an unanswered lease expires and its prompts are re-queued; a slow node's
    leases get 4x its expected time (at most 20x this)"""
    liveness_after_s: float = Field(3.0, gt=0.0, le=3600.0)
    """ping a live peer not heard from for this long"""
    ping_timeout_s: float = Field(3.0, gt=0.0, le=3600.0)
    """a ping unanswered this long marks the peer dead"""
    heartbeat_s: float = Field(2.0, gt=0.0, le=3600.0)
    """period of the liveness sweep"""
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
    max_peers_per_ip: int = Field(32, ge=0, le=1_000_000)
    """joined peers per IP address (an IPv6 address counts by its /64); a join beyond it is refused with
    peer_limit, so fresh identities from one host cannot flood the membership (0: no cap)"""
    plan_newcomers: int = Field(16, ge=0, le=4096)
    """peers that have not had a rollout accepted yet put in one broadcast plan (the rest catch up);
    workers are always in it"""
    plan_max_members: int = Field(1024, ge=1, le=4096)
    """peers in one broadcast plan at most, workers with the most accepted groups first"""
    idle_member_drop_s: float = Field(600.0, gt=0.0, le=86_400.0)
    """a member that never had a rollout accepted (and holds no lease, is not standby) is dropped this
    long after its join; it joins again if it is still there"""
    dead_member_drop_s: float = Field(60.0, gt=0.0, le=86_400.0)
    """a member that never worked is dropped this long after it stopped answering pings"""


class LearnerConfig(TrainingFields, LeaseFields, PeerFields):
    """``echorl learner``."""

    key: str = ""
    """key file (created if missing; default: DIR/learner.key with --checkpoint-dir, else a fresh key per run)"""
    addr_file: str = ""
    """write the bootstrap multiaddr here"""
    dht: bool = True
    """run the Kademlia DHT (--no-dht: nodes must bootstrap from the learner itself)"""
    eval_prompts: int = Field(1024, ge=1, le=10**6)
    """held-out prompts per evaluation"""
    full_every: FullEvery = 10
    fanout: int = Field(4, ge=1, le=64)
    """broadcast fanout (stripes)"""
    chunk_kib: int = Field(0, ge=0, le=limits.MAX_CHUNK_BYTES // 1024)
    """broadcast chunk size in KiB (0: per version, W/(16·fanout·depth) rounded to a power of two in
    64 KiB..1 MiB, which keeps the relay pipeline's fill under 1/16 of the transfer)"""
    broadcast_timeout_s: float = Field(120.0, gt=0.0, le=86_400.0)
    """how long one publication may take"""
    fetch_mbps_per_peer: float = Field(400.0, ge=0.0, le=1e6)
    """download rate one joined peer gets for catch-up and chunk requests (Mbit/s, bursts of 64 MiB), apart
    from the broadcast streams; peers that did not join get nothing (0: no per-peer limit)"""
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
    price_per_hour: float = Field(0.0, ge=0.0, le=1e6)
    """the learner's own price per hour: cost so far, per step and per 1,000 rollouts (learner/ledger.py)"""
    tensorboard: str = ""
    """also log every metrics row to this TensorBoard directory (needs the 'track' extra)"""


class TrainLocalConfig(TrainingFields):
    """``echorl train-local``: the learner and actor worker processes on this machine, no network."""

    steps: Steps = 400
    staleness: Staleness = 0
    eval_every: EvalEvery = 25
    actors: int = Field(3, ge=1, le=256)
    """actor worker processes"""
    actor_delay: float = Field(0.2, ge=0.0, le=3600.0)
    """seconds before a published version is visible to actors"""
    lease_prompts: int = Field(4, ge=1, le=limits.MAX_PROMPTS_PER_LEASE)
    """prompts per lease"""
    max_inflight: int = Field(0, ge=0, le=10**6)
    """prompts leased at once (0: B if S=0 else 2B)"""
    kl_coef: float = Field(0.0, ge=0.0, le=100.0)
    """weight of the k3 KL penalty to the initial model"""
    off_policy_correction: bool = True
    """clipped ratio + truncated IS against the behaviour policy (--no-off-policy-correction: the ablation)"""
    loss_norm: Literal["token", "sequence"] = "token"
    """average the loss over tokens or over sequences"""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """nucleus sampling threshold"""
    work_dir: str = ""
    """scratch directory for published weights (default: a temp dir)"""
    quiet: bool = False
    """no progress bar"""
