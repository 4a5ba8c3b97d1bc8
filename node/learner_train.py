"""The learner's training loop over network rollouts: GRPO steps, evaluation, publication,
metrics, and the provisioning rule of DESIGN §7. Compute runs in worker threads only."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from echorl.protocol.messages import SamplingSpec

if TYPE_CHECKING:
    from .learner_peer import LearnerConfig
    from .learner_service import LearnerService
    from .membership import Membership
    from .weights import WeightStore

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
    trained_prompt_ids: set[str] = field(default_factory=set)
    prompts_trained_twice: int = 0
    last_eval: float | None = None
    first_eval: float | None = None

    @classmethod
    def build(cls, cfg: "LearnerConfig") -> "Trainer":
        import torch

        from echorl.actor.backend import TorchBackend
        from echorl.actor.model import build_default_model
        from echorl.learner.buffer import StalenessBuffer
        from echorl.learner.grpo import GRPOConfig, GRPOTrainer
        from echorl.tasks import load_task

        torch.manual_seed(cfg.seed)
        model_dir = cfg.model or str(build_default_model(seed=cfg.seed))
        task = load_task(cfg.task, **cfg.task_options)
        backend = TorchBackend.from_pretrained(model_dir)
        gcfg = GRPOConfig(lr=cfg.lr, clip_low=cfg.clip, clip_high=cfg.clip, temperature=cfg.temperature)
        grpo = GRPOTrainer(backend.model, gcfg)
        buffer = StalenessBuffer(cfg.staleness, scorer=task.reward)
        vocab = int(backend.model.config.vocab_size)
        out = open(cfg.metrics_out, "w") if cfg.metrics_out else None  # noqa: SIM115 - closed in close()
        return cls(cfg, task, backend.tokenizer, grpo, buffer, backend, vocab, out)

    def sampling_spec(self) -> SamplingSpec:
        return SamplingSpec(temperature=self.cfg.temperature, top_p=1.0,
                            max_new_tokens=int(getattr(self.task, "max_new_tokens", 8)),
                            stop=list(getattr(self.task, "stop", []) or []))

    def close(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()

    def evaluate(self) -> float:
        """Mean task reward of one sampled completion per held-out prompt (fixed seed)."""
        from echorl.actor.types import SamplingParams

        prompts = self.task.eval_prompts()[: self.cfg.eval_prompts]
        spec = self.sampling_spec()
        params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p,
                                max_new_tokens=spec.max_new_tokens, stop=list(spec.stop))
        groups = self.backend.generate([p.text for p in prompts], 1, params, seed=1234)
        return sum(self.task.reward(p, g[0].text) for p, g in zip(prompts, groups)) / max(1, len(prompts))

    async def _eval(self) -> float:
        score = await trio.to_thread.run_sync(self.evaluate)
        self.last_eval = score
        if self.first_eval is None:
            self.first_eval = score
        return score

    async def loop(self, service: "LearnerService", store: "WeightStore", membership: "Membership | None") -> None:
        cfg = self.cfg
        eval0 = await self._eval()
        self._write({"step": 0, "version": 0, "eval_reward": eval0, "elapsed_s": 0.0})
        log.info("step 0: eval_reward %.3f", eval0)
        self.started = time.monotonic()
        window_start, window_groups = time.monotonic(), 0
        while cfg.steps <= 0 or self.step < cfg.steps:
            batch = self.buffer.take(cfg.prompts_per_step, service.version)
            if batch is None:
                service.accepted = trio.Event()
                with trio.move_on_after(1.0):
                    await service.accepted.wait()
                continue
            for g in batch:
                if g.prompt_id in self.trained_prompt_ids:
                    self.prompts_trained_twice += 1
                self.trained_prompt_ids.add(g.prompt_id)
            stale_max = max(service.version - g.behaviour_version for g in batch)
            metrics = await trio.to_thread.run_sync(self.grpo.train_step, batch)
            self.step += 1
            t_train = float(metrics["train_seconds"])
            self.train_seconds_total += t_train
            state = await trio.to_thread.run_sync(self.grpo.state_dict)
            pub = await store.publish(self.grpo.version, state)
            service.version = self.grpo.version
            fetch = store.fetch_seconds(self.grpo.version - 1)
            t_bcast = pub.build_seconds + (max(fetch) if fetch else 0.0)
            a = 0.2 if self.step > 1 else 1.0
            self.t_train_ema = (1 - a) * self.t_train_ema + a * t_train
            self.t_bcast_ema = (1 - a) * self.t_bcast_ema + a * t_bcast
            window_groups += len(batch)
            row = self._row(service, metrics, stale_max, t_bcast, window_groups / max(1e-9, time.monotonic() - window_start))
            if self.step % max(1, cfg.eval_every) == 0 or self.step == cfg.steps:
                row["eval_reward"] = await self._eval()
            self._write(row)
            service.learner_summary = self._summary(service, row)
            if self.step % 10 == 0 or self.step == cfg.steps:
                log.info("step %d: reward %.3f eval %s nodes %d stale_max %d", self.step, row["reward_mean"],
                         row.get("eval_reward", "-"), row["nodes_active"], row["staleness_max"])
            if time.monotonic() - window_start > 20:
                window_start, window_groups = time.monotonic(), 0

    def _row(self, service: "LearnerService", metrics: dict[str, Any], stale_max: int, t_bcast: float,
             rollouts_per_s: float) -> dict[str, Any]:
        cfg = self.cfg
        elapsed = time.monotonic() - self.started
        active = service.active_peers()
        available = sum(p.rollouts_per_s for p in active)
        required = required_throughput(1, cfg.prompts_per_step, self.t_train_ema, self.t_bcast_ema)
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
            "leases_expired": service.book.expired, "leases_issued": service.book.issued,
            "broadcast_seconds": t_bcast, "t_train_s": self.t_train_ema, "t_bcast_s": self.t_bcast_ema,
            "required_rollouts_per_s": required, "available_rollouts_per_s": available,
            "busy_fraction": self.train_seconds_total / max(1e-9, elapsed),
            "prompts_trained_twice": self.prompts_trained_twice, "elapsed_s": elapsed,
            "per_node_rollouts_per_s": {p.peer_id[:12]: round(p.rollouts_per_s, 3) for p in active},
            "per_node_groups": {p.peer_id[:12]: p.groups_accepted for p in service.peers.values()},
        }

    def _summary(self, service: "LearnerService", row: dict[str, Any]) -> dict[str, Any]:
        keep = ("step", "reward_mean", "staleness_max", "busy_fraction", "t_train_s", "t_bcast_s",
                "required_rollouts_per_s", "available_rollouts_per_s", "nodes_active", "elapsed_s")
        out = {k: row[k] for k in keep}
        out["eval_reward"] = self.last_eval
        out["steps_target"] = self.cfg.steps
        return out

    def _write(self, row: dict[str, Any]) -> None:
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(row) + "\n")
            self.metrics_file.flush()
