"""The learner peer's side of the shared training loop (``learner/loop.py``): building it from a
``LearnerConfig``, network rollouts as its :class:`~echorl.learner.loop.RolloutSource` (groups
arrive through ``LearnerService``, versions leave through the ``Publisher``, which never makes
training wait), and the provisioning rule of architecture §7 with its metrics."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from echorl.learner.loop import LoopSettings, TrainingLoop
from echorl.protocol.identity import short_id
from echorl.protocol.messages import SamplingSpec

if TYPE_CHECKING:
    from echorl.learner.config import LearnerConfig
    from echorl.learner.publish import BroadcastRecord, Publisher
    from echorl.learner.service import LearnerService

log = logging.getLogger("echorl.node.learner")


def required_throughput(kappa: int, rollouts_per_update: int, t_train: float, t_bcast: float) -> float | None:
    """Σμ needed so the learner never waits: κR / (κ·T_train − T_bcast); None if unbounded
    (T_bcast ≥ κ·T_train: no node set can keep up without a longer publication period)."""
    denom = kappa * t_train - t_bcast
    return None if denom <= 0 else kappa * rollouts_per_update / denom


def build_loop(cfg: "LearnerConfig") -> TrainingLoop:
    """Model (``cfg.model`` or the default tiny model for ``cfg.seed``), task, GRPO trainer and
    buffer of the learner peer, in one loop. Runs in a worker thread (loads weights)."""
    import torch

    from echorl.actor.backend import TorchBackend
    from echorl.actor.device import resolve_device
    from echorl.actor.model import default_model
    from echorl.learner.buffer import StalenessBuffer
    from echorl.learner.distributed import data_parallel
    from echorl.learner.grpo import GRPOConfig, GRPOTrainer
    from echorl.learner.replay import group_scorer
    from echorl.tasks import load_task

    torch.manual_seed(cfg.seed)
    model_dir = cfg.model or str(default_model())
    task = load_task(cfg.task, **cfg.task_options)
    device, dtype = resolve_device(cfg.device, cfg.dtype)
    backend = TorchBackend.from_pretrained(model_dir, device=device, dtype=dtype)
    grpo = data_parallel(GRPOTrainer(backend.model, GRPOConfig(lr=cfg.lr, clip_low=cfg.clip, clip_high=cfg.clip,
                                                               temperature=cfg.temperature, device=device, dtype=dtype)),
                         model_dir, cfg.nproc, cfg.seed)  # --nproc > 1: the step runs on worker ranks too
    replay = group_scorer(task, backend.tokenizer)  # episodic tasks: rewards come from replaying the episodes
    buffer = StalenessBuffer(cfg.staleness, scorer=None if replay else task.reward, group_scorer=replay)
    return TrainingLoop(loop_settings(cfg), task, grpo, buffer, backend)


def loop_settings(cfg: "LearnerConfig") -> LoopSettings:
    """The learner peer's configuration, as the shared loop reads it."""
    return LoopSettings(
        steps=cfg.steps, staleness=cfg.staleness, prompts_per_step=cfg.prompts_per_step,
        publish_every=cfg.publish_every, eval_every=cfg.eval_every, eval_prompts=cfg.eval_prompts, seed=cfg.seed,
        temperature=cfg.temperature, checkpoint_dir=cfg.checkpoint_dir, checkpoint_every=cfg.checkpoint_every,
        metrics_out=cfg.metrics_out, meta={"run_id": cfg.run_id, "task": cfg.task, "seed": cfg.seed})


def sampling_spec(loop: TrainingLoop) -> SamplingSpec:
    """What every lease asks the nodes to sample with (the loop's one sampling source)."""
    p = loop.sampling_params()
    return SamplingSpec(temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.max_new_tokens, stop=list(p.stop))


class Provisioning:
    """architecture §7: T_train and T_bcast (EMAs) and the throughput Σμ the nodes must supply."""

    def __init__(self, loop: TrainingLoop) -> None:
        self.loop = loop
        self.t_bcast_ema = 0.0

    def on_broadcast(self, rec: "BroadcastRecord") -> None:
        """Per completed broadcast: the capacity model's T_bcast (EMA)."""
        self.t_bcast_ema = rec.t_bcast if self.t_bcast_ema == 0 else 0.8 * self.t_bcast_ema + 0.2 * rec.t_bcast

    def required_rollouts_per_s(self) -> float | None:
        """The required Σμ from the current EMAs; None while unknown (no step trained yet) or
        unbounded. Read by the service for cost-aware activation."""
        loop = self.loop
        if loop.t_train_ema <= 0:
            return None
        return required_throughput(loop.kappa, loop.settings.prompts_per_step, loop.t_train_ema, self.t_bcast_ema)


class NetworkSource:
    """Rollouts from the joined nodes: wait for accepted submissions; offer versions to the
    publication task; the network's part of each metrics row."""

    def __init__(self, service: "LearnerService", publisher: "Publisher", provisioning: Provisioning) -> None:
        self.service, self.publisher, self.provisioning = service, publisher, provisioning

    async def wait(self) -> None:
        await self.service.wait_for_submission(1.0)

    async def publish(self, version: int, state_dict: dict[str, Any]) -> None:
        self.publisher.offer(version, state_dict)

    def after_step(self) -> None:
        """Nodes ask for leases themselves (paced by ``LeasePolicy.room``)."""

    def step_skipped(self, batch: list[Any], why: str) -> None:
        """Counted for status; after a non-finite step the contributors are flagged."""
        self.service.step_skipped(batch, why)

    def metrics(self) -> dict[str, Any]:
        service, publisher, prov = self.service, self.publisher, self.provisioning
        c = service.counters
        active = service.active_peers()
        last = publisher.last
        bcast = last.metrics() if last is not None else {"broadcast_seconds": None, "broadcast_version": None,
                                                          "broadcast_kind": None}
        return {
            "rollouts_rejected_stale": int(service.buffer.rollouts_rejected_stale) + c["submissions_rejected_stale"],
            "nodes_active": len(active), "signatures_verified": c["signatures_verified"],
            "rollouts_rejected_invalid": c["rollouts_rejected_invalid"],
            "submissions_rejected_replay": c["submissions_rejected_replay"],
            "rollouts_rejected_logprob": c["rollouts_rejected_logprob"],
            "rollouts_rejected_env": c["rollouts_rejected_env"],
            "spot_checks": c["spot_checks"], "spot_checks_skipped": c["spot_checks_skipped"],
            "spot_check_seconds": service.spot_check_seconds,
            "spot_check_passed_max_abs_diff": service.spot_check_passed_max_abs_diff,
            "peers_flagged": c["peers_flagged"], "peers_banned": c["peers_banned"], **service.roster.counters,
            **publisher.bc.server.counters,
            "connections_refused": publisher.bc.host.guard.refused + publisher.bc.server.direct_guard.refused,
            "leases_expired": service.book.expired, "leases_issued": service.book.issued,
            **bcast, "published_version": service.published, "broadcasts_skipped": publisher.skipped,
            "t_bcast_s": prov.t_bcast_ema, "required_rollouts_per_s": prov.required_rollouts_per_s(),
            "available_rollouts_per_s": sum(p.rollouts_per_s for p in active),
            "per_node_rollouts_per_s": {short_id(p.peer_id): round(p.rollouts_per_s, 3) for p in active},
            "per_node_groups": {short_id(p.peer_id): p.groups_accepted for p in service.peers.values()},
            "per_node_groups_generated": {short_id(p.peer_id): p.groups_generated for p in service.peers.values()},
            "per_node_version": {short_id(p.peer_id): p.version for p in service.peers.values()},
            **service.activation_metrics(), **self._ledger_row(last),
        }

    def _ledger_row(self, last: Any) -> dict[str, Any]:
        """Cost and rejections (learner/ledger.py), and the labelled maps /metrics exports."""
        service, loop = self.service, self.provisioning.loop
        led = service.ledger
        led.gen_samples_per_s = loop.gen_samples_per_s  # the learner's own generation rate (eval)
        out = led.metrics(service.peers.values(), loop.version, service.policy.group_size)
        out["cost_by_part"] = {"learner": out["cost_learner"], "nodes": out["cost_nodes"]}
        out["submissions_rejected_by_reason"] = led.rejections_by_reason()
        out["per_node_submissions_rejected"] = {short_id(p): a.rejected_total for p, a in led.accounts.items()}
        if last is not None:
            out["broadcast_seconds_by_kind"] = {last.kind: last.seconds}
        return out
