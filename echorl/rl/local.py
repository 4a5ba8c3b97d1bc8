"""``echorl train-local``: the learner and A actor worker processes on this machine, no network.

The learner (this process) leases prompts to actors through a queue, receives rollout groups,
recomputes their rewards with the task verifier, applies the staleness rule (buffer), trains
one GRPO step per batch of ``--prompts-per-step`` accepted groups and publishes weights every
κ steps into a directory the actors read (visible after ``--actor-delay`` seconds). It writes
one JSON line per learner step (``--metrics-out``), shows a rich progress bar and prints a
summary. Heavy imports stay inside functions so ``--help`` is fast.

The training itself is the learner peer's loop, built by the same builder (``rl/build.py``:
the same κ, leasable version, in-flight bound, evaluation, metrics row and checkpoint);
:class:`ActorSource` is its rollout source here. The actors sample every lease seeded
(``actor/seeded.py``, as a network node samples a lease's ``sampling_seed``), the seed derived
from ``--seed``, the learner's version and the lease id: the samples of a lease do not depend on
which actor takes it, so a run whose versions are leased in a fixed order (``--staleness 0``)
repeats its metrics rows exactly.
``busy_fraction`` = time inside ``train_step`` + publishing, divided by the wall time since the
first step minus the time spent on held-out evaluation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echorl.common import config
from echorl.rl.config import TrainLocalConfig

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    import trio
    from rich.console import Console
    from rich.progress import Progress, TaskID

    from echorl.actor.types import RolloutGroup
    from echorl.actor.worker import LeaseResult
    from echorl.rl.loop import TrainingLoop
    from echorl.tasks.base import Prompt, Task


def add_arguments(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p, TrainLocalConfig)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = config.configured(TrainLocalConfig, args, "train-local")
    if isinstance(cfg, int):
        return cfg
    from echorl.rl.build import NO_CHECKPOINTS, checkpoint_dir
    from echorl.rl.checkpoint import finished_run
    from echorl.tasks import load_task

    try:
        if cfg.resume and cfg.checkpoint_dir.lower() in ("", NO_CHECKPOINTS):
            raise config.ConfigError("--resume needs --checkpoint-dir")
        if cfg.resume and (done := finished_run(cfg.checkpoint_dir, cfg.steps)):
            print(f"echorl train-local: {done}", file=sys.stderr)
            return 0
        if cfg.task == "addition":
            cfg.task_options.setdefault("seed", cfg.seed)
        task = load_task(cfg.task, **cfg.task_options)  # TaskError is a ValueError
        cfg.check_task(task)
        cfg.check_model()
        from echorl.actor.device import pin_device

        device = pin_device(cfg)
        from echorl.rl.distributed import check_world

        check_world(cfg.device, cfg.nproc)
        cfg.checkpoint_dir = checkpoint_dir(cfg.checkpoint_dir, f"train-local-{cfg.task}")  # kept by default
    except (ValueError, OSError) as exc:  # OSError: the default checkpoint directory cannot be made
        config.fail("train-local", exc)
        return 2
    print(f"echorl train-local: learner and actors on {device}", file=sys.stderr, flush=True)
    return _run_local(cfg, task)


def _run_local(cfg: TrainLocalConfig, task: Task) -> int:
    import tempfile

    import torch
    import trio
    from rich.console import Console

    from echorl.rl.build import build_loop, model_path
    from echorl.rl.distributed import DistributedError

    console = Console(stderr=True)
    torch.set_num_threads(1)  # the actors are processes of their own
    model_dir = model_path(cfg)
    try:
        loop = build_loop(cfg, task, keep_rows=True)
        if cfg.resume:
            loop.resume()
    except DistributedError as exc:  # the data-parallel ranks could not start (or resume)
        print(f"echorl train-local: {exc}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="echorl-local-") as tmp:
        weights_dir = Path(cfg.work_dir or tmp) / "weights"
        source = ActorSource(cfg, loop, model_dir, weights_dir)
        source.publish_now(loop.version, loop.grpo.published_state())
        loop.open_metrics()
        source.start()
        t0 = time.perf_counter()
        try:
            trio.run(_train, loop, source, console, cfg)
        finally:
            source.close()
            loop.close()
    _summary(console, loop, source, model_dir, time.perf_counter() - t0)
    return 1 if loop.failed else 0  # a data-parallel worker was lost: checkpointed, one line said why


async def _train(loop: TrainingLoop, source: ActorSource, console: Console, cfg: TrainLocalConfig) -> None:
    import trio
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    plain = not cfg.quiet and not console.is_terminal  # a log file: plain lines, not a collapsed bar
    with Progress(
        TextColumn("[bold]train-local"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        disable=cfg.quiet or plain,
    ) as bar:
        job = bar.add_task("", total=cfg.steps, completed=loop.version)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(source.pump)
            if plain:
                loop.sinks.append(_PlainLines(loop))
            else:
                nursery.start_soon(_show_progress, bar, job, loop)
            await loop.run(source)
            if cfg.checkpoint_dir:
                await loop.checkpoint()
            nursery.cancel_scope.cancel()


def _progress_line(row: dict[str, Any], last_eval: float | None) -> str:
    return (
        f"reward {row['reward_mean']:.3f} eval {'-' if last_eval is None else f'{last_eval:.3f}'} "
        f"stale≤{row['staleness_step_max']} rejected {row['rollouts_rejected_stale']} busy {row['busy_fraction']:.3f}"
    )


async def _show_progress(bar: Progress, job: TaskID, loop: TrainingLoop) -> None:
    import trio

    while True:
        row = loop.last_row
        if row is not None and row["step"] > 0:
            bar.update(job, completed=row["step"], description=_progress_line(row, loop.last_eval))
        await trio.sleep(0.2)


class _PlainLines:
    """A metrics sink for output that is not a terminal (a log file): a line every 10 steps, on
    each eval and at the end, where a progress bar would collapse into one truncated line."""

    def __init__(self, loop: TrainingLoop) -> None:
        self.loop = loop

    def write(self, row: dict[str, Any]) -> None:
        step, steps = row["step"], self.loop.settings.steps
        if step > 0 and (step % 10 == 0 or row.get("eval_reward") is not None or step == steps):
            print(
                f"train-local step {step}/{steps} {row['elapsed_s']:.0f} s {_progress_line(row, self.loop.last_eval)}",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        pass


class ActorSource:
    """Rollouts from A actor worker processes through multiprocessing queues: leases out
    prompts (at most ``max_inflight`` at once, for the loop's leasable version), takes their
    groups into the loop's buffer, re-queues expired leases, publishes versions into a
    directory the actors read. Queue reads run in worker threads; the buffer is touched on the
    event loop only."""

    def __init__(self, cfg: TrainLocalConfig, loop: TrainingLoop, model_dir: Path, weights_dir: Path) -> None:
        from echorl.tasks.env import env_options_of, is_episodic

        self.cfg, self.loop, self.model_dir, self.weights_dir = cfg, loop, model_dir, weights_dir
        self.env = (cfg.task, env_options_of(loop.task)) if is_episodic(loop.task) else None
        self.max_inflight = cfg.max_inflight or loop.rule.in_flight_cap
        self.leases: dict[int, tuple[list[Prompt], float]] = {}
        self.lease_id = self.leases_expired = 0
        self.published = -1
        self.gen_s = 0.0
        self.procs: list[BaseProcess] = []
        self._accepted: trio.Event | None = None

    # --- actor processes -----------------------------------------------------------------
    def start(self) -> None:
        import multiprocessing as mp

        from echorl.actor.worker import actor_main

        ctx = mp.get_context("spawn")
        self.lease_q, self.result_q, self.stop = ctx.Queue(), ctx.Queue(), ctx.Event()
        self.procs = [
            ctx.Process(
                target=actor_main,
                daemon=True,
                name=f"echorl-actor-{i}",
                args=(
                    i,
                    str(self.model_dir),
                    str(self.weights_dir),
                    self.lease_q,
                    self.result_q,
                    self.stop,
                    self.cfg.actor_delay,
                    self.cfg.seed * 100 + i,
                    self.cfg.device,
                    self.cfg.dtype,
                    self.cfg.lora_settings(),
                ),
            )
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

        publish_weights(self.weights_dir, state_dict, version, keep=max(8, self.loop.rule.bound + self.loop.kappa + 2))
        self.published = version

    def after_step(self) -> None:
        """Lease between steps, after a publication: a lease issued while a step trains would be
        generated with weights one step older and arrive closer to the staleness bound."""
        self._lease_more()

    def step_skipped(self, batch: list[RolloutGroup], why: str) -> None:
        """Local actors are trusted: the loop's counters say enough."""

    def metrics(self) -> dict[str, Any]:
        return {
            "published_version": self.published,
            "leases_expired": self.leases_expired,
            "leases_issued": self.lease_id,
            "actor_generate_seconds": self.gen_s,
        }

    # --- leases and results --------------------------------------------------------------
    async def pump(self) -> None:
        """Forever: take results in, expire overdue leases (work is leased out by ``wait`` and
        ``after_step``, and once here at the start)."""
        import trio

        self._lease_more()
        while True:
            for res in await trio.to_thread.run_sync(self._results, 0.2):
                await self._take(res)
            self._expire(time.time())
            if not any(p.is_alive() for p in self.procs):
                raise RuntimeError("all actor processes exited")

    def _lease_more(self) -> None:
        from echorl.actor.seeded import derived_seed
        from echorl.actor.worker import Lease

        buffer = self.loop.buffer
        min_version = self.loop.min_version(self.published)
        params = self.loop.sampling_params()
        while (room := self.max_inflight - len(buffer.outstanding) - len(buffer)) > 0:
            prompts = buffer.next_prompts(self.loop.task, min(self.cfg.lease_prompts, room))
            self.lease_id += 1
            self.leases[self.lease_id] = (prompts, time.time() + self.cfg.lease_timeout_s)
            seed = derived_seed(self.cfg.seed, self.loop.version, self.lease_id)  # the same samples run to run
            self.lease_q.put(Lease(self.lease_id, prompts, self.cfg.group_size, params, min_version, self.env, seed))

    def _results(self, timeout: float) -> list[LeaseResult]:
        """Every result waiting in the queue (blocking up to ``timeout`` for the first)."""
        import queue

        out: list[LeaseResult] = []
        try:
            out.append(self.result_q.get(timeout=timeout))
            while True:
                out.append(self.result_q.get_nowait())
        except queue.Empty:
            pass
        return out

    async def _take(self, res: LeaseResult) -> None:
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


def _summary(console: Console, loop: TrainingLoop, source: ActorSource, model_dir: Path, seconds: float) -> None:
    from rich.table import Table

    steps = [r for r in loop.rows or [] if r["step"] > 0]  # train-local keeps every row
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
    if loop.settings.checkpoint_dir:  # a plain line: a table would cut the path
        print(
            f"checkpoint: {loop.settings.checkpoint_dir} (--resume --checkpoint-dir DIR continues it)", file=sys.stderr
        )


def _first_last(steps: list[dict[str, Any]]) -> str:
    if not steps:
        return "n/a"
    f = [r["reward_mean"] for r in steps[:10]]
    last = [r["reward_mean"] for r in steps[-10:]]
    return f"{sum(f) / len(f):.3f} → {sum(last) / len(last):.3f}"
