"""The learner's training loop over network rollouts: GRPO steps, evaluation, offering versions
to the publication task every κ steps (it never waits for a broadcast), checkpoints, metrics, and
the provisioning rule of DESIGN §7. Compute runs in worker threads only."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from echorl.protocol.identity import short_id
from echorl.protocol.messages import SamplingSpec

if TYPE_CHECKING:
    from echorl.learner.peer import LearnerConfig
    from echorl.learner.publish import BroadcastRecord, Publisher
    from echorl.learner.service import LearnerService
    from echorl.net.membership import Membership

TRAINED_IDS_KEPT = 200_000  # prompt ids remembered across a resume (for prompts_trained_twice)

log = logging.getLogger("echorl.node.learner")


def required_throughput(kappa: int, rollouts_per_update: int, t_train: float, t_bcast: float) -> float | None:
    """Σμ needed so the learner never waits: κR / (κ·T_train − T_bcast); None if unbounded
    (T_bcast ≥ κ·T_train: no node set can keep up without a longer publication period)."""
    denom = kappa * t_train - t_bcast
    return None if denom <= 0 else kappa * rollouts_per_update / denom


@dataclass
class Trainer:
    cfg: "LearnerConfig"
    task: Any
    tokenizer: Any
    grpo: Any
    buffer: Any
    backend: Any  # a TorchBackend over the trainer's own model, for evaluation
    vocab_size: int
    metrics_file: Any = None
    step: int = 0
    started: float = field(default_factory=time.monotonic)
    train_seconds_total: float = 0.0
    t_train_ema: float = 0.0
    t_bcast_ema: float = 0.0
    trained_prompt_ids: dict[str, None] = field(default_factory=dict)  # insertion-ordered
    prompts_trained_twice: int = 0
    last_eval: float | None = None
    first_eval: float | None = None
    resumed_from: int | None = None
    resume_extra: dict[str, Any] = field(default_factory=dict)
    service_state: Callable[[], dict[str, Any]] = dict  # the network service's part of a checkpoint
    stopping: bool = False  # set on SIGTERM: the loop ends at the next step boundary
    sinks: list[Any] = field(default_factory=list)  # besides the JSONL: Prometheus, TensorBoard (echorl/metrics_sinks.py)
    gen_samples_per_s: float = 0.0  # the learner's own generation rate, measured by evaluation
    last_row: dict[str, Any] = field(default_factory=dict)

    @property
    def kappa(self) -> int:
        """Publication period κ: ``publish_every`` or max(1, S−1), at most max(1, S) so a
        published version is always recent enough to be leased work."""
        cfg = self.cfg
        return max(1, min(cfg.publish_every or max(1, cfg.staleness - 1), max(1, cfg.staleness)))

    def required_rollouts_per_s(self) -> float | None:
        """The provisioning rule's required Σμ from the current EMAs; None while unknown (no
        step trained yet) or unbounded. Handed to the service for cost-aware activation."""
        if self.t_train_ema <= 0:
            return None
        return required_throughput(self.kappa, self.cfg.prompts_per_step, self.t_train_ema, self.t_bcast_ema)

    @classmethod
    def build(cls, cfg: "LearnerConfig") -> "Trainer":
        import torch

        from echorl.actor.backend import TorchBackend
        from echorl.actor.device import resolve_device
        from echorl.actor.model import build_default_model
        from echorl.learner.buffer import StalenessBuffer
        from echorl.learner.grpo import GRPOConfig, GRPOTrainer
        from echorl.tasks import load_task

        torch.manual_seed(cfg.seed)
        model_dir = cfg.model or str(build_default_model(seed=cfg.seed))
        task = load_task(cfg.task, **cfg.task_options)
        device, dtype = resolve_device(cfg.device, cfg.dtype)
        backend = TorchBackend.from_pretrained(model_dir, device=device, dtype=dtype)
        gcfg = GRPOConfig(lr=cfg.lr, clip_low=cfg.clip, clip_high=cfg.clip, temperature=cfg.temperature, device=device,
                          dtype=dtype)
        grpo = GRPOTrainer(backend.model, gcfg)
        from echorl.learner.replay import group_scorer

        replay = group_scorer(task, backend.tokenizer)  # episodic tasks: rewards come from replaying the episodes
        buffer = StalenessBuffer(cfg.staleness, scorer=None if replay else task.reward, group_scorer=replay)
        vocab = int(backend.model.config.vocab_size)
        return cls(cfg, task, backend.tokenizer, grpo, buffer, backend, vocab)

    def open_metrics(self) -> None:
        if self.cfg.metrics_out:
            mode = "a" if self.resumed_from is not None else "w"
            self.metrics_file = open(self.cfg.metrics_out, mode)  # noqa: SIM115 - closed in close()

    # --- checkpoints --------------------------------------------------------------------------
    def resume(self) -> bool:
        """Load the newest checkpoint of ``cfg.checkpoint_dir`` (model, optimizer, version, RNG,
        task cursor, pending prompts); False if there is none. Runs in a worker thread."""
        from echorl.learner.checkpoint import has_checkpoint, load_checkpoint, restore_trainer

        if not self.cfg.checkpoint_dir or not has_checkpoint(self.cfg.checkpoint_dir):
            return False
        ck = load_checkpoint(self.cfg.checkpoint_dir)
        restore_trainer(self.grpo, ck)
        self.task.seek(ck.cursor)
        self.buffer.requeue(ck.pending)
        self.trained_prompt_ids = dict.fromkeys(ck.extra.get("trained_prompt_ids", []))
        self.step = self.grpo.version
        self.resumed_from = self.grpo.version
        self.resume_extra = dict(ck.extra)
        return True

    def save(self, cursor: int, pending: list[Any], trained: list[str], service_state: dict[str, Any]) -> str:
        """Atomic checkpoint at the current version; ``cursor`` and ``pending`` (every prompt
        not trained yet: buffered, re-queued and leased) taken at one instant on the loop.
        Runs in a worker thread, between steps."""
        from echorl.learner.checkpoint import save_checkpoint

        extra = {"run_id": self.cfg.run_id, "task": self.cfg.task, "seed": self.cfg.seed,
                 "trained_prompt_ids": trained, "service": service_state}
        return str(save_checkpoint(self.cfg.checkpoint_dir, self.grpo, cursor, pending, extra=extra))

    async def checkpoint(self) -> None:
        t0 = time.perf_counter()
        pending = self.buffer.pending_prompts()  # leases issued while saving are after the cursor
        trained = list(self.trained_prompt_ids)[-TRAINED_IDS_KEPT:]
        path = await trio.to_thread.run_sync(self.save, self.task.cursor, pending, trained, self.service_state())
        log.info("checkpoint v%d (%d prompts pending) in %.2f s: %s", self.grpo.version, len(pending),
                 time.perf_counter() - t0, path)

    def sampling_spec(self) -> SamplingSpec:
        return SamplingSpec(temperature=self.cfg.temperature, top_p=1.0,
                            max_new_tokens=int(getattr(self.task, "max_new_tokens", 8)),
                            stop=list(getattr(self.task, "stop", []) or []))

    def close(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
        for sink in self.sinks:
            sink.close()

    def evaluate(self) -> float:
        """Mean task reward of one sampled completion per held-out prompt (fixed seed)."""
        from echorl.actor.types import SamplingParams

        prompts = self.task.eval_prompts()[: self.cfg.eval_prompts]
        spec = self.sampling_spec()
        params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p,
                                max_new_tokens=spec.max_new_tokens, stop=list(spec.stop))
        t0 = time.perf_counter()
        if getattr(self.task, "episodic", False):
            from echorl.actor.episodes import evaluate

            score = evaluate(self.backend, self.task, prompts, params, seed=1234)
            self.gen_samples_per_s = len(prompts) / max(1e-9, time.perf_counter() - t0)  # episodes/s
            return score
        groups = self.backend.generate([p.text for p in prompts], 1, params, seed=1234)
        self.gen_samples_per_s = len(prompts) / max(1e-9, time.perf_counter() - t0)
        return sum(self.task.reward(p, g[0].text) for p, g in zip(prompts, groups)) / max(1, len(prompts))

    async def _eval(self) -> float:
        score = await trio.to_thread.run_sync(self.evaluate)
        self.last_eval = score
        if self.first_eval is None:
            self.first_eval = score
        return score

    async def loop(self, service: "LearnerService", publisher: "Publisher", membership: "Membership | None") -> None:
        """Train until ``cfg.steps`` versions or ``self.stopping``; offer every κ-th version."""
        cfg = self.cfg
        if self.resumed_from is None:
            eval0 = await self._eval()
            self._write({"step": 0, "version": 0, "eval_reward": eval0, "elapsed_s": 0.0})
            log.info("step 0: eval_reward %.3f", eval0)
            service.ledger.gen_samples_per_s = self.gen_samples_per_s
        self.started = time.monotonic()
        window = [time.monotonic(), 0]
        while (cfg.steps <= 0 or self.grpo.version < cfg.steps) and not self.stopping:
            batch = self.buffer.take(cfg.prompts_per_step, service.version)
            if batch is None:
                service.accepted = trio.Event()
                with trio.move_on_after(1.0):
                    await service.accepted.wait()
                continue
            await self._step(service, publisher, batch, window)

    async def _step(self, service: "LearnerService", publisher: "Publisher", batch: list[Any], window: list) -> None:
        cfg = self.cfg
        for g in batch:
            if g.prompt_id in self.trained_prompt_ids:
                self.prompts_trained_twice += 1
            self.trained_prompt_ids[g.prompt_id] = None
        stale_max = max(service.version - g.behaviour_version for g in batch)
        metrics = await trio.to_thread.run_sync(self.grpo.train_step, batch)
        self.step = self.grpo.version
        service.version = self.grpo.version
        t_train = float(metrics["train_seconds"])
        self.train_seconds_total += t_train
        self.t_train_ema = t_train if self.t_train_ema == 0 else 0.8 * self.t_train_ema + 0.2 * t_train
        if self.step % self.kappa == 0 or self.step == cfg.steps:
            publisher.offer(self.step, await trio.to_thread.run_sync(self.grpo.state_dict))
        window[1] += len(batch)
        row = self._row(service, publisher, metrics, stale_max, window[1] / max(1e-9, time.monotonic() - window[0]))
        if self.step % max(1, cfg.eval_every) == 0 or self.step == cfg.steps:
            row["eval_reward"] = await self._eval()
            service.ledger.gen_samples_per_s = self.gen_samples_per_s
        self._write(row)
        service.learner_summary = self._summary(service, row)
        if self.step % 10 == 0 or self.step == cfg.steps:
            ev = row.get("eval_reward")
            log.info("step %d: reward %.3f eval %s nodes %d stale_max %d bcast v%s cost %.4f", self.step,
                     row["reward_mean"], "-" if ev is None else f"{ev:.3f}", row["nodes_active"], row["staleness_max"],
                     row["broadcast_version"], row["cost_total"])
        if cfg.checkpoint_dir and cfg.checkpoint_every > 0 and self.step % cfg.checkpoint_every == 0:
            await self.checkpoint()
        if time.monotonic() - window[0] > 20:
            window[:] = [time.monotonic(), 0]

    def on_broadcast(self, rec: "BroadcastRecord") -> None:
        """Per completed broadcast: the capacity model's T_bcast (EMA)."""
        self.t_bcast_ema = rec.t_bcast if self.t_bcast_ema == 0 else 0.8 * self.t_bcast_ema + 0.2 * rec.t_bcast

    def _row(self, service: "LearnerService", publisher: "Publisher", metrics: dict[str, Any], stale_max: int,
             rollouts_per_s: float) -> dict[str, Any]:
        cfg = self.cfg
        elapsed = time.monotonic() - self.started
        active = service.active_peers()
        available = sum(p.rollouts_per_s for p in active)
        required = required_throughput(self.kappa, cfg.prompts_per_step, self.t_train_ema, self.t_bcast_ema)
        last = publisher.last
        bcast = last.metrics() if last is not None else {"broadcast_seconds": None, "broadcast_version": None,
                                                          "broadcast_kind": None}
        bc = self.buffer.counters()
        return {
            "step": self.step, "version": int(metrics["version"]), "reward_mean": float(metrics["reward_mean"]),
            "loss": float(metrics["loss"]), "train_seconds": float(metrics["train_seconds"]),
            "staleness_step_max": stale_max, "staleness_max": int(bc["staleness_max"]),
            "staleness_mean": float(bc["staleness_mean"]), "rollouts_accepted": int(bc["rollouts_accepted"]),
            "rollouts_rejected_stale": int(bc["rollouts_rejected_stale"]) + service.counters["submissions_rejected_stale"],
            "rollouts_per_s": rollouts_per_s, "nodes_active": len(active),
            "signatures_verified": service.counters["signatures_verified"],
            "rollouts_rejected_invalid": service.counters["rollouts_rejected_invalid"],
            "submissions_rejected_replay": service.counters["submissions_rejected_replay"],
            "rollouts_rejected_logprob": service.counters["rollouts_rejected_logprob"],
            "rollouts_rejected_env": service.counters["rollouts_rejected_env"],
            "spot_checks": service.counters["spot_checks"],
            "spot_checks_skipped": service.counters["spot_checks_skipped"],
            "spot_check_seconds": service.spot_check_seconds,
            "spot_check_passed_max_abs_diff": service.spot_check_passed_max_abs_diff,
            "peers_flagged": service.counters["peers_flagged"], "peers_banned": service.counters["peers_banned"],
            "leases_expired": service.book.expired, "leases_issued": service.book.issued,
            **bcast, "published_version": service.published, "publish_every": self.kappa,
            "broadcasts_skipped": publisher.skipped, "t_train_s": self.t_train_ema, "t_bcast_s": self.t_bcast_ema,
            "required_rollouts_per_s": required, "available_rollouts_per_s": available,
            "busy_fraction": self.train_seconds_total / max(1e-9, elapsed),
            "prompts_trained_twice": self.prompts_trained_twice, "elapsed_s": elapsed,
            "per_node_rollouts_per_s": {short_id(p.peer_id): round(p.rollouts_per_s, 3) for p in active},
            "per_node_groups": {short_id(p.peer_id): p.groups_accepted for p in service.peers.values()},
            "per_node_groups_generated": {short_id(p.peer_id): p.groups_generated for p in service.peers.values()},
            "per_node_version": {short_id(p.peer_id): p.version for p in service.peers.values()},
            **service.activation_metrics(), **self._ledger_row(service, last),
        }

    def _ledger_row(self, service: "LearnerService", last: Any) -> dict[str, Any]:
        """Cost and rejections (learner/ledger.py), and the labelled maps /metrics exports."""
        led = service.ledger
        out = led.metrics(service.peers.values(), self.step, service.policy.group_size)
        out["cost_by_part"] = {"learner": out["cost_learner"], "nodes": out["cost_nodes"]}
        out["submissions_rejected_by_reason"] = led.rejections_by_reason()
        out["per_node_submissions_rejected"] = {short_id(p): a.rejected_total for p, a in led.accounts.items()}
        if last is not None:
            out["broadcast_seconds_by_kind"] = {last.kind: last.seconds}
        return out

    def _summary(self, service: "LearnerService", row: dict[str, Any]) -> dict[str, Any]:
        keep = ("step", "reward_mean", "staleness_max", "busy_fraction", "t_train_s", "t_bcast_s",
                "required_rollouts_per_s", "available_rollouts_per_s", "nodes_active", "nodes_standby",
                "activation", "activation_target_per_s", "elapsed_s")
        out = {k: row[k] for k in keep}
        out["eval_reward"] = self.last_eval
        out["steps_target"] = self.cfg.steps
        return out

    def _write(self, row: dict[str, Any]) -> None:
        """The one row goes to the JSONL file and to every sink."""
        self.last_row = {**self.last_row, **row}
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(row) + "\n")
            self.metrics_file.flush()
        for sink in self.sinks:
            sink.write(row)
