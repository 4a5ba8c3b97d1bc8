"""``echorl train-local``: the learner and A actor worker processes on this machine, no network.

The learner (this process) leases prompts to actors through a queue, receives rollout groups,
recomputes their rewards with the task verifier, applies the staleness rule (buffer), trains
one GRPO step per batch of ``--prompts-per-step`` accepted groups and publishes weights every
κ steps into a directory the actors read (visible after ``--actor-delay`` seconds). It writes
one JSON line per learner step (``--metrics-out``), shows a rich progress bar and prints a
summary. Heavy imports stay inside functions so ``--help`` is fast.

The training itself is the learner peer's loop (``learner/loop.py``: the same κ, leasable
version, evaluation, metrics row and checkpoint); :class:`ActorSource` is its rollout source here.
``busy_fraction`` = time inside ``train_step`` + publishing, divided by the wall time since the
first step minus the time spent on held-out evaluation.
"""

from __future__ import annotations

import argparse
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
        from echorl.learner.distributed import check_world

        check_world(cfg.device, cfg.nproc)
    except ValueError as exc:
        config.fail("train-local", exc)
        return 2
    print(f"echorl train-local: learner and actors on {device}", file=sys.stderr, flush=True)
    return _run_local(cfg, task)


def _build(cfg: TrainLocalConfig, task: Any) -> tuple[Any, Path]:
    """The shared training loop over this run's model, GRPO trainer and buffer."""
    import torch
    from transformers import AutoTokenizer

    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import default_model
    from echorl.learner.buffer import StalenessBuffer
    from echorl.learner.grpo import GRPOConfig, GRPOTrainer
    from echorl.learner.distributed import data_parallel
    from echorl.learner.loop import TrainingLoop
    from echorl.learner.replay import group_scorer

    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed)
    model_dir = Path(cfg.model) if cfg.model else default_model()
    grpo = data_parallel(GRPOTrainer(model_dir, GRPOConfig(
        lr=cfg.lr, clip_low=cfg.clip, clip_high=cfg.clip, kl_coef=cfg.kl_coef, loss_norm=cfg.loss_norm,
        temperature=cfg.temperature, device=cfg.device, dtype=cfg.dtype,
        off_policy_correction=cfg.off_policy_correction)), model_dir, cfg.nproc, cfg.seed)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    replay = group_scorer(task, tok)  # episodic tasks: rewards come from replaying the episodes
    buffer = StalenessBuffer(cfg.staleness, scorer=None if replay else task.reward, group_scorer=replay)
    return TrainingLoop(loop_settings(cfg), task, grpo, buffer, TorchBackend(grpo.model, tok), keep_rows=True), model_dir


def loop_settings(cfg: TrainLocalConfig) -> Any:
    """train-local's configuration, as the shared loop reads it."""
    from echorl.learner.loop import LoopSettings

    return LoopSettings(
        steps=cfg.steps, staleness=cfg.staleness, prompts_per_step=cfg.prompts_per_step,
        publish_every=cfg.publish_every, eval_every=cfg.eval_every, seed=cfg.seed, temperature=cfg.temperature,
        top_p=cfg.top_p, checkpoint_dir=cfg.checkpoint_dir, checkpoint_every=cfg.checkpoint_every,
        metrics_out=cfg.metrics_out, meta={"task": cfg.task, "seed": cfg.seed})


def _run_local(cfg: TrainLocalConfig, task: Any) -> int:
    import tempfile

    import trio
    from rich.console import Console

    console = Console(stderr=True)
    loop, model_dir = _build(cfg, task)
    if cfg.resume:
        loop.resume()
    with tempfile.TemporaryDirectory(prefix="echorl-local-") as tmp:
        weights_dir = Path(cfg.work_dir or tmp) / "weights"
        source = ActorSource(cfg, loop, model_dir, weights_dir)
        source.publish_now(loop.version, loop.grpo.state_dict())
        loop.open_metrics()
        source.start()
        t0 = time.perf_counter()
        try:
            trio.run(_train, loop, source, console, cfg)
        finally:
            source.close()
            loop.close()
    _summary(console, loop, source, model_dir, time.perf_counter() - t0)
    return 0


async def _train(loop: Any, source: "ActorSource", console: Any, cfg: TrainLocalConfig) -> None:
    import trio
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    plain = not cfg.quiet and not console.is_terminal  # a log file: plain lines, not a collapsed bar
    with Progress(TextColumn("[bold]train-local"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, disable=cfg.quiet or plain) as bar:
        job = bar.add_task("", total=cfg.steps, completed=loop.version)
        async with trio.open_nursery() as nursery:
            await nursery.start(source.pump)
            if plain:
                loop.sinks.append(_PlainLines(loop))
            else:
                nursery.start_soon(_show_progress, bar, job, loop)
            await loop.run(source)
            if cfg.checkpoint_dir:
                await loop.checkpoint()
            nursery.cancel_scope.cancel()


def _progress_line(row: dict[str, Any], last_eval: float | None) -> str:
    return (f"reward {row['reward_mean']:.3f} eval {'-' if last_eval is None else f'{last_eval:.3f}'} "
            f"stale≤{row['staleness_step_max']} rejected {row['rollouts_rejected_stale']} busy {row['busy_fraction']:.3f}")


async def _show_progress(bar: Any, job: Any, loop: Any) -> None:
    import trio

    while True:
        row = loop.last_row
        if row is not None and row["step"] > 0:
            bar.update(job, completed=row["step"], description=_progress_line(row, loop.last_eval))
        await trio.sleep(0.2)


class _PlainLines:
    """A metrics sink for output that is not a terminal (a log file): a line every 10 steps, on
    each eval and at the end, where a progress bar would collapse into one truncated line."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    def write(self, row: dict[str, Any]) -> None:
        step, steps = row["step"], self.loop.settings.steps
        if step > 0 and (step % 10 == 0 or row.get("eval_reward") is not None or step == steps):
            print(f"train-local step {step}/{steps} {row['elapsed_s']:.0f} s {_progress_line(row, self.loop.last_eval)}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class ActorSource:
    """Rollouts from A actor worker processes through multiprocessing queues: leases out
    prompts (at most ``max_inflight`` at once, for the loop's leasable version), takes their
    groups into the loop's buffer, re-queues expired leases, publishes versions into a
    directory the actors read. Queue reads run in worker threads; the buffer is touched on the
    event loop only."""

    LEASE_TIMEOUT_S = 120.0

    def __init__(self, cfg: TrainLocalConfig, loop: Any, model_dir: Path, weights_dir: Path) -> None:
        from echorl.tasks.env import env_options_of, is_episodic

        self.cfg, self.loop, self.model_dir, self.weights_dir = cfg, loop, model_dir, weights_dir
        self.env = (cfg.task, env_options_of(loop.task)) if is_episodic(loop.task) else None
        b = cfg.prompts_per_step
        self.max_inflight = cfg.max_inflight or (b if cfg.staleness == 0 else 2 * b)
        self.leases: dict[int, tuple[list[Any], float]] = {}
        self.lease_id = self.leases_expired = 0
        self.published = -1
        self.gen_s = 0.0
        self.procs: list[Any] = []
        self._accepted: Any = None

    # --- actor processes -----------------------------------------------------------------
    def start(self) -> None:
        import multiprocessing as mp

        from echorl.actor.worker import actor_main

        ctx = mp.get_context("spawn")
        self.lease_q, self.result_q, self.stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        self.procs = [
            ctx.Process(target=actor_main, daemon=True, name=f"echorl-actor-{i}",
                        args=(i, str(self.model_dir), str(self.weights_dir), self.lease_q, self.result_q,
                              self.stop, self.cfg.actor_delay, self.cfg.seed * 100 + i, self.cfg.device,
                              self.cfg.dtype))
            for i in range(self.cfg.actors)
        ]
        for p in self.procs:
            p.start()

    def close(self) -> None:
        import queue

        if not self.procs:
            return
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
        self.procs = []

    # --- RolloutSource -------------------------------------------------------------------
    async def wait(self) -> None:
        import trio

        self._lease_more()
        self._accepted = trio.Event()
        with trio.move_on_after(1.0):
            await self._accepted.wait()

    async def publish(self, version: int, state_dict: dict[str, Any]) -> None:
        import trio

        await trio.to_thread.run_sync(self.publish_now, version, state_dict)

    def publish_now(self, version: int, state_dict: dict[str, Any]) -> None:
        from echorl.actor.worker import publish_weights

        publish_weights(self.weights_dir, state_dict, version, keep=max(8, self.cfg.staleness + self.loop.kappa + 2))
        self.published = version

    def after_step(self) -> None:
        """Lease between steps, after a publication: a lease issued while a step trains would be
        generated with weights one step older and arrive closer to the staleness bound."""
        self._lease_more()

    def step_skipped(self, batch: list[Any], why: str) -> None:
        """Local actors are trusted: the loop's counters say enough."""

    def metrics(self) -> dict[str, Any]:
        return {"published_version": self.published, "leases_expired": self.leases_expired,
                "leases_issued": self.lease_id, "actor_generate_seconds": self.gen_s}

    # --- leases and results --------------------------------------------------------------
    async def pump(self, task_status: Any = None) -> None:
        """Forever: take results in, expire overdue leases (work is leased out by ``wait`` and
        ``after_step``, and once here at the start)."""
        import trio

        if task_status is not None:
            task_status.started()
        self._lease_more()
        while True:
            for res in await trio.to_thread.run_sync(self._results, 0.2):
                await self._take(res)
            self._expire(time.time())
            if not any(p.is_alive() for p in self.procs):
                raise RuntimeError("all actor processes exited")

    def _lease_more(self) -> None:
        from echorl.actor.worker import Lease

        buffer = self.loop.buffer
        min_version = self.loop.min_version(self.published)
        params = self.loop.sampling_params()
        while (room := self.max_inflight - len(buffer.outstanding) - len(buffer)) > 0:
            prompts = buffer.next_prompts(self.loop.task, min(self.cfg.lease_prompts, room))
            self.lease_id += 1
            self.leases[self.lease_id] = (prompts, time.time() + self.LEASE_TIMEOUT_S)
            self.lease_q.put(Lease(self.lease_id, prompts, self.cfg.group_size, params, min_version, self.env))

    def _results(self, timeout: float) -> list[Any]:
        """Every result waiting in the queue (blocking up to ``timeout`` for the first)."""
        import queue

        out: list[Any] = []
        try:
            out.append(self.result_q.get(timeout=timeout))
            while True:
                out.append(self.result_q.get_nowait())
        except queue.Empty:
            pass
        return out

    async def _take(self, res: Any) -> None:
        import trio

        if self.leases.pop(res.lease_id, None) is None:
            return  # expired lease: its prompts were re-queued already
        if res.error:
            raise RuntimeError(f"actor {res.actor} failed:\n{res.error}")
        self.gen_s += res.generate_s
        buffer = self.loop.buffer
        rewards = await trio.to_thread.run_sync(buffer.score, res.groups)  # the verifier: off the event loop
        for g, r in zip(res.groups, rewards):
            buffer.offer(g, self.loop.version, r)
        if self._accepted is not None:
            self._accepted.set()

    def _expire(self, now: float) -> None:
        buffer = self.loop.buffer
        for lid, (prompts, deadline) in list(self.leases.items()):
            if deadline < now:
                del self.leases[lid]
                self.leases_expired += 1
                buffer.requeue([p for p in prompts if p.prompt_id in buffer.outstanding])


def _summary(console: Any, loop: Any, source: ActorSource, model_dir: Path, seconds: float) -> None:
    from rich.table import Table

    steps = [r for r in loop.rows if r["step"] > 0]
    c = loop.buffer.counters()
    first, last = loop.first_eval, loop.last_eval
    t = Table(title="echorl train-local summary", show_header=False)
    items = [
        ("task / model", f"{loop.task.name} / {model_dir}"),
        ("steps (this run) / version", f"{len(steps)} / {loop.version}"),
        ("eval_reward start → end", f"{first:.3f} → {last:.3f}" if first is not None and last is not None else "n/a"),
        ("reward_mean first10 → last10", _first_last(steps)),
        ("rollouts accepted / rejected stale", f"{c['rollouts_accepted']} / {c['rollouts_rejected_stale']}"),
        ("staleness max / mean", f"{c['staleness_max']} / {c['staleness_mean']:.2f}"),
        ("busy_fraction", f"{steps[-1]['busy_fraction']:.2f}" if steps else "n/a"),
        ("seconds (s/step)", f"{seconds:.1f} ({seconds / max(1, len(steps)):.3f})"),
        ("actor generate seconds (sum)", f"{source.gen_s:.1f}"),
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
