"""``echorl train-local``: the learner and A actor worker processes on this machine, no network.

The learner (this process) leases prompts to actors through a queue, receives rollout groups,
recomputes their rewards with the task verifier, applies the staleness rule (buffer), trains
one GRPO step per batch of ``--prompts-per-step`` accepted groups and publishes weights every
κ steps into a directory the actors read (visible after ``--actor-delay`` seconds). It writes
one JSON line per learner step (``--metrics-out``), shows a rich progress bar and prints a
summary. Heavy imports stay inside functions so ``--help`` is fast.

``learner_busy_frac`` = time inside ``train_step`` + publishing, divided by the wall time since
the first rollout arrived (actor start-up excluded) minus the time spent on held-out evaluation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from echorl import config
from echorl.learner.config import TrainLocalConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p, TrainLocalConfig)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = config.configured(TrainLocalConfig, args, "train-local")
    if isinstance(cfg, int):
        return cfg
    from echorl.tasks import load_task

    try:
        if cfg.resume and not cfg.checkpoint_dir:
            raise config.ConfigError("--resume needs --checkpoint-dir")
        if cfg.task == "addition":
            cfg.task_options.setdefault("seed", cfg.seed)
        task = load_task(cfg.task, **cfg.task_options)  # TaskError is a ValueError
        cfg.check_model()
        device = cfg.pin_device()
    except ValueError as exc:
        config.fail("train-local", exc)
        return 2
    print(f"echorl train-local: learner and actors on {device}", file=sys.stderr, flush=True)
    return _Loop(cfg, task).run()


class _Loop:
    """State of one local training run (kept in one object to keep ``run`` readable)."""

    def __init__(self, args: TrainLocalConfig, task: Any) -> None:
        self.args, self.task = args, task

    def setup(self) -> None:
        import tempfile

        import torch

        from echorl.actor.backend import TorchBackend
        from echorl.actor.model import build_default_model
        from echorl.actor.types import SamplingParams
        from echorl.learner.buffer import StalenessBuffer
        from echorl.learner.grpo import GRPOConfig, GRPOTrainer
        from echorl.tasks.env import env_options_of

        a = self.args
        torch.set_num_threads(1)
        torch.manual_seed(a.seed)
        self.model_dir = Path(a.model) if a.model else build_default_model(seed=a.seed)
        cfg = GRPOConfig(lr=a.lr, clip_low=a.clip, clip_high=a.clip, kl_coef=a.kl_coef,
                         loss_norm=a.loss_norm, temperature=a.temperature, device=a.device, dtype=a.dtype)
        self.trainer = GRPOTrainer(self.model_dir, cfg)
        from transformers import AutoTokenizer

        from echorl.learner.replay import group_scorer
        from echorl.tasks import is_episodic

        tok = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        replay = group_scorer(self.task, tok)  # episodic tasks: rewards come from replaying the episodes
        self.buffer = StalenessBuffer(a.staleness, scorer=None if replay else self.task.reward, group_scorer=replay)
        self.env = (a.task, env_options_of(self.task)) if is_episodic(self.task) else None
        self.kappa = a.publish_every or max(1, a.staleness - 1)
        self.B = a.prompts_per_step
        self.max_inflight = a.max_inflight or (self.B if a.staleness == 0 else 2 * self.B)
        self.params = SamplingParams(temperature=a.temperature, top_p=a.top_p,
                                     max_new_tokens=int(getattr(self.task, "max_new_tokens", 32)),
                                     stop=list(getattr(self.task, "stop", []) or []))
        self.eval_backend = TorchBackend(self.trainer.model, tok)
        self.eval_set = self.task.eval_prompts()
        self.eval_ids = [self.eval_backend.encode(p.text) for p in self.eval_set]
        self._tmp = None
        if a.work_dir:
            self.weights_dir = Path(a.work_dir) / "weights"
        else:
            self._tmp = tempfile.TemporaryDirectory(prefix="echorl-local-")
            self.weights_dir = Path(self._tmp.name) / "weights"
        self.resumed = False
        if a.resume:
            from echorl.learner.checkpoint import has_checkpoint, load_checkpoint, restore_trainer

            if has_checkpoint(a.checkpoint_dir):
                ck = load_checkpoint(a.checkpoint_dir)
                restore_trainer(self.trainer, ck)
                self.task.seek(ck.cursor)
                self.buffer.requeue(ck.pending)
                self.resumed = True

    def evaluate(self) -> float:
        t0 = time.perf_counter()
        if self.env is not None:
            from echorl.actor.episodes import evaluate

            score = evaluate(self.eval_backend, self.task, self.eval_set, self.params, self.args.seed + 7919)
            self.eval_s += time.perf_counter() - t0
            return score
        samples = self.eval_backend.sample_ids(self.eval_ids, self.params, seed=self.args.seed + 7919)
        score = sum(self.task.reward(p, s.text) for p, s in zip(self.eval_set, samples)) / len(samples)
        self.eval_s += time.perf_counter() - t0
        return score

    def publish(self) -> None:
        from echorl.actor.worker import publish_weights

        publish_weights(self.weights_dir, self.trainer.state_dict(), self.trainer.version,
                        keep=max(8, self.args.staleness + self.kappa + 2))
        self.published = self.trainer.version

    def start_actors(self) -> None:
        import multiprocessing as mp

        from echorl.actor.worker import actor_main

        ctx = mp.get_context("spawn")
        self.lease_q, self.result_q, self.stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        self.procs = [
            ctx.Process(target=actor_main, daemon=True, name=f"echorl-actor-{i}",
                        args=(i, str(self.model_dir), str(self.weights_dir), self.lease_q, self.result_q,
                              self.stop, self.args.actor_delay, self.args.seed * 100 + i, self.args.device,
                              self.args.dtype))
            for i in range(self.args.actors)
        ]
        for p in self.procs:
            p.start()

    def stop_actors(self) -> None:
        import queue

        self.stop.set()
        for _ in self.procs:
            self.lease_q.put(None)
        deadline = time.time() + 10
        for p in self.procs:
            while p.is_alive() and time.time() < deadline:
                try:  # drain so no worker blocks on a full pipe
                    self.result_q.get(timeout=0.05)
                except queue.Empty:
                    pass
            if p.is_alive():
                p.terminate()
            p.join(timeout=2)
        for q in (self.lease_q, self.result_q):
            q.cancel_join_thread()
            q.close()

    def lease_more(self) -> None:
        from echorl.actor.worker import Lease

        t, S = self.trainer.version, self.args.staleness
        min_version = min(self.published, max(0, t - max(0, S - 1)))
        while len(self.buffer.outstanding) + len(self.buffer) < self.max_inflight:
            n = min(self.args.lease_prompts, self.max_inflight - len(self.buffer.outstanding) - len(self.buffer))
            prompts = self.buffer.next_prompts(self.task, n)
            self.lease_id += 1
            self.leases[self.lease_id] = (prompts, time.time() + self.lease_timeout)
            self.lease_q.put(Lease(self.lease_id, prompts, self.args.group_size, self.params, min_version, self.env))

    def collect(self, timeout: float) -> None:
        import queue

        block = True
        while True:
            try:
                res = self.result_q.get(timeout=timeout) if block else self.result_q.get_nowait()
            except queue.Empty:
                break
            block = False
            if self.leases.pop(res.lease_id, None) is None:
                continue  # expired lease: its prompts were re-queued already
            if res.error:
                raise RuntimeError(f"actor {res.actor} failed:\n{res.error}")
            self.gen_s += res.generate_s
            if self.t_first is None:
                self.t_first, self.eval_s0 = time.perf_counter(), self.eval_s
            for g in res.groups:
                self.buffer.offer(g, self.trainer.version)
        now = time.time()
        for lid, (prompts, deadline) in list(self.leases.items()):
            if deadline < now:
                del self.leases[lid]
                self.buffer.requeue([p for p in prompts if p.prompt_id in self.buffer.outstanding])
        if not any(p.is_alive() for p in self.procs):
            raise RuntimeError("all actor processes exited")

    def run(self) -> int:
        from rich.console import Console

        console = Console(stderr=True)
        self.setup()
        a = self.args
        self.eval_s, self.gen_s, self.busy_s, self.lease_id = 0.0, 0.0, 0.0, 0
        self.t_first: float | None = None
        self.eval_s0 = 0.0
        self.leases: dict[int, tuple[list, float]] = {}
        self.lease_timeout = 120.0
        self.publish()
        mode = "a" if self.resumed else "w"
        out = open(a.metrics_out, mode) if a.metrics_out else None
        self.start_actors()
        t_start = time.perf_counter()
        first_eval = self.evaluate()
        rows: list[dict[str, Any]] = []

        def emit(row: dict[str, Any]) -> None:
            rows.append(row)
            if out:
                out.write(json.dumps(row) + "\n")
                out.flush()

        base = {"rollouts_accepted": 0, "rollouts_rejected_stale": 0, "staleness_max": 0,
                "staleness_mean": 0.0, "learner_busy_frac": 0.0}
        if not self.resumed:
            emit({"step": 0, "version": self.trainer.version, "reward_mean": None, "eval_reward": first_eval,
                  **base, "seconds": 0.0})
        try:
            self._train(emit, console, t_start)
        finally:
            self.stop_actors()
            if out:
                out.close()
            if self._tmp:
                self._tmp.cleanup()
        self.summary(console, rows, first_eval, time.perf_counter() - t_start)
        return 0

    def _train(self, emit: Any, console: Any, t_start: float) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        a = self.args
        last_eval = None
        plain = not a.quiet and not console.is_terminal  # a log file: plain lines, not a collapsed bar
        with Progress(TextColumn("[bold]train-local"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.description}"), console=console, disable=a.quiet or plain) as bar:
            job = bar.add_task("", total=a.steps, completed=self.trainer.version)
            while self.trainer.version < a.steps:
                self.lease_more()
                self.collect(timeout=0.0 if len(self.buffer) >= self.B else 0.5)
                batch = self.buffer.take(self.B, self.trainer.version)
                if batch is None:
                    continue
                staleness = [self.trainer.version - g.behaviour_version for g in batch]
                t0 = time.perf_counter()
                m = self.trainer.train_step(batch)
                if self.trainer.version % self.kappa == 0 or self.trainer.version == a.steps:
                    self.publish()
                self.busy_s += time.perf_counter() - t0
                v = self.trainer.version
                ev = None
                if v % a.eval_every == 0 or v == a.steps:
                    ev = last_eval = self.evaluate()
                if a.checkpoint_dir and ((a.checkpoint_every and v % a.checkpoint_every == 0) or v == a.steps):
                    self.checkpoint()
                wall = time.perf_counter() - t_start
                c = self.buffer.counters()
                emit({"step": v, "version": v, "reward_mean": m["reward_mean"], "eval_reward": ev,
                      "rollouts_accepted": c["rollouts_accepted"],
                      "rollouts_rejected_stale": c["rollouts_rejected_stale"],
                      "staleness_max": max(staleness), "staleness_mean": sum(staleness) / len(staleness),
                      "learner_busy_frac": self.busy_frac(),
                      "seconds": round(wall, 3), "loss": m["loss"], "clip_frac": m["clip_frac"],
                      "tis_frac": m["tis_frac"], "logp_abs_diff": m["logp_abs_diff"],
                      "train_seconds": m["train_seconds"], "published_version": self.published})
                line = (f"reward {m['reward_mean']:.3f} eval {'-' if last_eval is None else f'{last_eval:.3f}'} "
                        f"stale≤{max(staleness)} rejected {c['rollouts_rejected_stale']} busy {self.busy_frac():.3f}")
                bar.update(job, completed=v, description=line)
                if plain and (v % 10 == 0 or ev is not None or v == a.steps):
                    print(f"train-local step {v}/{a.steps} {wall:.0f} s {line}", file=sys.stderr, flush=True)

    def busy_frac(self) -> float:
        if self.t_first is None:
            return 0.0
        span = time.perf_counter() - self.t_first - (self.eval_s - self.eval_s0)
        return self.busy_s / max(1e-9, span)

    def checkpoint(self) -> None:
        from echorl.learner.checkpoint import save_checkpoint

        save_checkpoint(self.args.checkpoint_dir, self.trainer, self.task.cursor, self.buffer.pending_prompts(),
                        extra={"task": self.args.task, "seed": self.args.seed})

    def summary(self, console: Any, rows: list[dict[str, Any]], first_eval: float, seconds: float) -> None:
        from rich.table import Table

        steps = [r for r in rows if r["step"] > 0]
        evals = [r["eval_reward"] for r in rows if r["eval_reward"] is not None]
        c = self.buffer.counters()
        t = Table(title="echorl train-local summary", show_header=False)
        items = [
            ("task / model", f"{self.task.name} / {self.model_dir}"),
            ("steps (this run) / version", f"{len(steps)} / {self.trainer.version}"),
            ("eval_reward start → end", f"{first_eval:.3f} → {evals[-1]:.3f}" if evals else "n/a"),
            ("reward_mean first10 → last10", _first_last(steps)),
            ("rollouts accepted / rejected stale", f"{c['rollouts_accepted']} / {c['rollouts_rejected_stale']}"),
            ("staleness max / mean", f"{c['staleness_max']} / {c['staleness_mean']:.3f}"),
            ("learner busy fraction", f"{steps[-1]['learner_busy_frac']:.3f}" if steps else "n/a"),
            ("seconds (s/step)", f"{seconds:.1f} ({seconds / max(1, len(steps)):.3f})"),
            ("actor generate seconds (sum)", f"{self.gen_s:.1f}"),
        ]
        for k, v in items:
            t.add_row(k, v)
        console.print(t)


def _first_last(steps: list[dict[str, Any]]) -> str:
    if not steps:
        return "n/a"
    f = [r["reward_mean"] for r in steps[:10]]
    last = [r["reward_mean"] for r in steps[-10:]]
    return f"{sum(f) / len(f):.3f} → {sum(last) / len(last):.3f}"
