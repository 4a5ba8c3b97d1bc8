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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="addition", help="built-in task name or module:Class")
    p.add_argument("--task-option", action="append", metavar="KEY=VALUE", help="task constructor option (repeatable)")
    p.add_argument("--model", default=None, help="local HF model directory (default: build/reuse the tiny default model)")
    p.add_argument("--steps", type=int, default=400, help="train until this many optimizer steps (versions)")
    p.add_argument("--staleness", type=int, default=0, help="S: use a rollout of version b at step t iff t-b <= S")
    p.add_argument("--publish-every", type=int, default=None, help="κ: publish weights every κ steps (default max(1, S-1))")
    p.add_argument("--actors", type=int, default=3, help="actor worker processes")
    p.add_argument("--actor-delay", type=float, default=0.2, help="seconds before a published version is visible to actors")
    p.add_argument("--group-size", type=int, default=8, help="G samples per prompt")
    p.add_argument("--prompts-per-step", type=int, default=16, help="accepted groups per optimizer step")
    p.add_argument("--lease-prompts", type=int, default=4, help="prompts per lease")
    p.add_argument("--max-inflight", type=int, default=None, help="prompts leased at once (default B if S=0 else 2B)")
    p.add_argument("--lr", type=float, default=5e-4, help="AdamW learning rate (0 leaves the weights untouched)")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip epsilon")
    p.add_argument("--kl-coef", type=float, default=0.0, help="weight of the k3 KL penalty to the initial model")
    p.add_argument("--loss-norm", choices=["token", "sequence"], default="token", help="average the loss over tokens or over sequences")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--seed", type=int, default=0, help="seed of prompt order, sampling, and the default model")
    p.add_argument("--eval-every", type=int, default=25, help="held-out evaluation period in steps (and at the end)")
    p.add_argument("--metrics-out", default=None, help="JSONL file, one line per step")
    p.add_argument("--checkpoint-dir", default=None, help="where to write checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint period in steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--work-dir", default=None, help="scratch directory for published weights (default: a temp dir)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from echorl.tasks import TaskError, load_task, parse_task_options

    if args.steps < 0 or args.staleness < 0 or args.actors < 1 or args.group_size < 2 or args.prompts_per_step < 1:
        print("echorl train-local: need --steps >= 0, --staleness >= 0, --actors >= 1, --group-size >= 2, "
              "--prompts-per-step >= 1", file=sys.stderr)
        return 2
    if args.resume and not args.checkpoint_dir:
        print("echorl train-local: --resume needs --checkpoint-dir", file=sys.stderr)
        return 2
    try:
        options = parse_task_options(args.task_option)
        if args.task == "addition":
            options.setdefault("seed", args.seed)
        task = load_task(args.task, **options)
    except TaskError as exc:
        print(f"echorl train-local: {exc}", file=sys.stderr)
        return 2
    if args.model and not (Path(args.model) / "config.json").is_file():
        print(f"echorl train-local: --model {args.model} is not a HF model directory (no config.json)", file=sys.stderr)
        return 2
    return _run_local(args, task)


def _build(args: argparse.Namespace, task: Any) -> tuple[Any, Path]:
    """The shared training loop over this run's model, GRPO trainer and buffer."""
    import torch
    from transformers import AutoTokenizer

    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import build_default_model
    from echorl.learner.buffer import StalenessBuffer
    from echorl.learner.grpo import GRPOConfig, GRPOTrainer
    from echorl.learner.loop import TrainingLoop

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model_dir = Path(args.model) if args.model else build_default_model(seed=args.seed)
    grpo = GRPOTrainer(model_dir, GRPOConfig(lr=args.lr, clip_low=args.clip, clip_high=args.clip, kl_coef=args.kl_coef,
                                             loss_norm=args.loss_norm, temperature=args.temperature))
    backend = TorchBackend(grpo.model, AutoTokenizer.from_pretrained(model_dir, local_files_only=True))
    return TrainingLoop(loop_settings(args), task, grpo, StalenessBuffer(args.staleness, scorer=task.reward),
                        backend, keep_rows=True), model_dir


def loop_settings(args: argparse.Namespace) -> Any:
    """train-local's arguments, as the shared loop reads them."""
    from echorl.learner.loop import LoopSettings

    return LoopSettings(
        steps=args.steps, staleness=args.staleness, prompts_per_step=args.prompts_per_step,
        publish_every=args.publish_every, eval_every=args.eval_every, seed=args.seed, temperature=args.temperature,
        top_p=args.top_p, checkpoint_dir=args.checkpoint_dir or "", checkpoint_every=args.checkpoint_every,
        metrics_out=args.metrics_out or "", meta={"task": args.task, "seed": args.seed})


def _run_local(args: argparse.Namespace, task: Any) -> int:
    import tempfile

    import trio
    from rich.console import Console

    console = Console(stderr=True)
    loop, model_dir = _build(args, task)
    if args.resume:
        loop.resume()
    with tempfile.TemporaryDirectory(prefix="echorl-local-") as tmp:
        weights_dir = Path(args.work_dir or tmp) / "weights"
        source = ActorSource(args, loop, model_dir, weights_dir)
        source.publish_now(loop.version, loop.grpo.state_dict())
        loop.open_metrics()
        source.start()
        t0 = time.perf_counter()
        try:
            trio.run(_train, loop, source, console, args)
        finally:
            source.close()
            loop.close()
    _summary(console, loop, source, model_dir, time.perf_counter() - t0)
    return 0


async def _train(loop: Any, source: "ActorSource", console: Any, args: argparse.Namespace) -> None:
    import trio
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]train-local"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.description}"), console=console, disable=args.quiet) as bar:
        job = bar.add_task("", total=args.steps, completed=loop.version)
        async with trio.open_nursery() as nursery:
            await nursery.start(source.pump)
            nursery.start_soon(_show_progress, bar, job, loop)
            await loop.run(source)
            if args.checkpoint_dir:
                await loop.checkpoint()
            nursery.cancel_scope.cancel()


async def _show_progress(bar: Any, job: Any, loop: Any) -> None:
    import trio

    while True:
        row = loop.last_row
        if row is not None and row["step"] > 0:
            ev = loop.last_eval if loop.last_eval is not None else float("nan")
            bar.update(job, completed=row["step"], description=(
                f"reward {row['reward_mean']:.2f} eval {ev:.2f} stale≤{row['staleness_step_max']} "
                f"rejected {row['rollouts_rejected_stale']} busy {row['busy_fraction']:.2f}"))
        await trio.sleep(0.2)


class ActorSource:
    """Rollouts from A actor worker processes through multiprocessing queues: leases out
    prompts (at most ``max_inflight`` at once, for the loop's leasable version), takes their
    groups into the loop's buffer, re-queues expired leases, publishes versions into a
    directory the actors read. Queue reads run in worker threads; the buffer is touched on the
    event loop only."""

    LEASE_TIMEOUT_S = 120.0

    def __init__(self, args: argparse.Namespace, loop: Any, model_dir: Path, weights_dir: Path) -> None:
        self.args, self.loop, self.model_dir, self.weights_dir = args, loop, model_dir, weights_dir
        b = args.prompts_per_step
        self.max_inflight = args.max_inflight or (b if args.staleness == 0 else 2 * b)
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
                              self.stop, self.args.actor_delay, self.args.seed * 100 + i))
            for i in range(self.args.actors)
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

        publish_weights(self.weights_dir, state_dict, version, keep=max(8, self.args.staleness + self.loop.kappa + 2))
        self.published = version

    def after_step(self) -> None:
        """Lease between steps, after a publication: a lease issued while a step trains would be
        generated with weights one step older and arrive closer to the staleness bound."""
        self._lease_more()

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
            prompts = buffer.next_prompts(self.loop.task, min(self.args.lease_prompts, room))
            self.lease_id += 1
            self.leases[self.lease_id] = (prompts, time.time() + self.LEASE_TIMEOUT_S)
            self.lease_q.put(Lease(self.lease_id, prompts, self.args.group_size, params, min_version))

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
