"""The one GRPO training loop, shared by the learner peer and ``echorl train-local``.

Both feed the same loop from a :class:`RolloutSource` (the network service, or local actor
worker processes) and get the same rules: the publication period κ and the oldest leasable
version (both from the run's :class:`~echorl.rl.staleness.StalenessRule`), one held-out
evaluation (same prompts, same seed, at step 0, every ``eval_every`` steps and at the end; exact
where the task can compute its expected reward, ``rl/exact_eval.py``), one
metrics row, one checkpoint layout. The policy version lives in
``grpo.version`` alone; everything else reads it.

Components own their state: the loop, the buffer and whatever the caller :meth:`attaches
<TrainingLoop.attach>` (service, publisher) expose ``state_dict()`` / ``load_state_dict()``,
and the checkpoint's ``extra`` is assembled from them under their names. Compute (GRPO steps,
evaluation, weight copies, checkpoint writes) runs in worker threads, never on the event loop.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol

import trio

from echorl.actor.types import SamplingParams
from echorl.rl.checkpoint import check_state_keys
from echorl.rl.distributed import DistributedError
from echorl.rl.staleness import StalenessRule
from echorl.tasks import reward_errors

if TYPE_CHECKING:
    from echorl.actor.backend import TorchBackend
    from echorl.actor.types import RolloutGroup
    from echorl.rl.buffer import StalenessBuffer
    from echorl.rl.seams import MetricsSink, Trainer
    from echorl.tasks.base import Task
    from echorl.tasks.selfplay import SelfPlay

log = logging.getLogger(__name__)

TRAINED_IDS_KEPT = 200_000  # prompt ids remembered across a resume (for prompts_trained_twice)
EVAL_SEED_OFFSET = 7919  # held-out sampling seed = run seed + this, in every evaluation
OPPONENT_TABLE = "_opponent_table"  # the evaluation's self-play snapshot, taken out before the row


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class RolloutSource(Protocol):
    """Where rollout groups come from. Groups reach ``loop.buffer``; the loop only waits."""

    async def wait(self) -> None:
        """Return when more groups may be buffered (or after at most ~1 s)."""

    async def publish(self, version: int, state_dict: dict[str, Any]) -> None:
        """Make ``version`` available to the actors (never waits for a broadcast)."""

    def after_step(self) -> None:
        """A step (and its publication, if any) is done: a moment to hand out more work."""

    def metrics(self) -> dict[str, Any]:
        """Source-specific fields of the metrics row (may override the loop's)."""

    def step_skipped(self, batch: list[RolloutGroup], why: str) -> None:
        """The loop dropped ``batch`` untrained (``why``: "nonfinite", "empty", "invalid")."""


@dataclass
class LoopSettings:
    """What the loop needs of a run's configuration (each CLI maps its own config here)."""

    steps: int  # stop at this version (0: until stopped)
    staleness: int
    prompts_per_step: int
    publish_every: int | None = None
    eval_every: int = 10
    eval_prompts: int = 0  # periodic evaluations use the first this many held-out prompts (0: all)
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    checkpoint_dir: str = ""
    checkpoint_every: int = 0  # steps; 0: only at the end
    metrics_out: str = ""
    meta: dict[str, Any] = field(default_factory=dict)  # run_id, task, seed: written to every checkpoint


class TrainingLoop:
    """GRPO steps over the buffer, evaluation, publication every κ steps, checkpoints, metrics."""

    def __init__(
        self,
        settings: LoopSettings,
        task: Task,
        grpo: Trainer,
        buffer: StalenessBuffer,
        eval_backend: TorchBackend,
        *,
        keep_rows: bool = False,
    ) -> None:
        self.settings, self.task, self.grpo, self.buffer = settings, task, grpo, buffer
        self.rule = StalenessRule(settings.staleness, settings.prompts_per_step)  # every staleness rule
        self.eval_backend = eval_backend
        self.parts: dict[str, Stateful] = {"buffer": buffer}
        self.self_play: SelfPlay | None = getattr(task, "self_play", None)  # the task's opponent history
        if self.self_play is not None:
            self.parts["self_play"] = self.self_play
        self.resumed_extra: dict[str, Any] | None = None  # the checkpoint's extra, after a resume
        self.stopping = False  # set on SIGTERM: the loop ends at the next step boundary
        self.failed: str | None = None  # why training could not go on (a data-parallel worker was lost)
        self.trained_prompt_ids: dict[str, None] = {}  # insertion-ordered
        self.prompts_trained_twice = 0
        # what hostile or broken input cost: steps skipped, versions withheld, failed checkpoints
        self.faults = {
            "train_steps_skipped_nonfinite": 0,
            "train_batches_dropped": 0,
            "versions_withheld_nonfinite": 0,
            "checkpoint_failures": 0,
        }
        self.checkpoint_retry = False  # the last checkpoint failed: try again after the next step
        self.first_eval: float | None = None
        self.last_eval: float | None = None
        self.busy_s = self.eval_s = self.eval_s_at_first = self.t_train_ema = 0.0
        self.t_first: float | None = None  # when the first batch was trained
        self.started = time.monotonic()
        self.summary: dict[str, Any] = {}
        self.last_row: dict[str, Any] | None = None
        self.rows: list[dict[str, Any]] | None = [] if keep_rows else None  # every row of this run, if kept
        self._window = [time.monotonic(), 0]
        self._metrics_file: IO[str] | None = None
        self.sinks: list[MetricsSink] = []  # besides the JSONL: Prometheus, TensorBoard (echorl/metrics_sinks.py)
        self.gen_samples_per_s = 0.0  # the learner's own generation rate, measured by evaluation

    # --- rules ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return int(self.grpo.version)

    @property
    def kappa(self) -> int:
        return self.rule.kappa(self.settings.publish_every)

    def min_version(self, published: int) -> int:
        """The oldest version an actor may be leased work for now (``rl/staleness.py``)."""
        return self.rule.min_version(self.version, published)

    def sampling_params(self) -> SamplingParams:
        """Rollout and evaluation sampling: the run's temperature/top-p, the task's
        ``max_new_tokens`` and stop strings (the one source of both)."""
        s = self.settings
        return SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            max_new_tokens=int(self.task.max_new_tokens),
            stop=list(self.task.stop or []),
        )

    def stop(self) -> None:
        """End at the next step boundary (SIGTERM)."""
        self.stopping = True

    @property
    def done(self) -> bool:
        return self.stopping or (self.settings.steps > 0 and self.version >= self.settings.steps)

    # --- state ---------------------------------------------------------------------------
    def attach(self, name: str, part: Stateful) -> None:
        """Include ``part`` in checkpoints under ``name``; after a resume, load its saved state."""
        self.parts[name] = part
        if self.resumed_extra is not None and name in self.resumed_extra:
            part.load_state_dict(self.resumed_extra[name])

    _STATE_KEYS = {"trained_prompt_ids", "prompts_trained_twice", "first_eval", "last_eval"}

    def state_dict(self) -> dict[str, Any]:
        return {
            "trained_prompt_ids": list(self.trained_prompt_ids)[-TRAINED_IDS_KEPT:],
            "prompts_trained_twice": self.prompts_trained_twice,
            "first_eval": self.first_eval,
            "last_eval": self.last_eval,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = check_state_keys("training loop", state, self._STATE_KEYS)
        ids = state.get("trained_prompt_ids", [])
        self.trained_prompt_ids = dict.fromkeys(str(i) for i in ids[-TRAINED_IDS_KEPT:])
        self.prompts_trained_twice = int(state.get("prompts_trained_twice", 0))
        self.first_eval = _opt_float(state.get("first_eval"))
        self.last_eval = _opt_float(state.get("last_eval"))

    def resume(self) -> bool:
        """Load the newest checkpoint (model, optimizer, version, RNG, task cursor, the loop's
        and buffer's state); False if there is none. Parts attached later load theirs then.
        Runs in a worker thread, before training."""
        from echorl.rl.checkpoint import has_checkpoint, load_checkpoint, restore_trainer

        root = self.settings.checkpoint_dir
        if not root or not has_checkpoint(root):
            return False
        ck = load_checkpoint(root)
        restore_trainer(self.grpo, ck)
        self.task.seek(ck.cursor)
        extra = dict(ck.extra)
        if "buffer" not in extra:  # written before the buffer owned its state
            self.buffer.requeue(ck.pending)
        self.resumed_extra = extra
        for name, part in self.parts.items():
            if name in extra:
                part.load_state_dict(extra[name])
        if "loop" in extra:
            self.load_state_dict(extra["loop"])
        return True

    async def checkpoint(self) -> str:
        """Atomic checkpoint at the current version: every part's state taken at one instant on
        the event loop (leases issued while saving are after the cursor), written in a thread."""
        from echorl.rl.checkpoint import save_checkpoint

        t0 = time.perf_counter()
        meta = dict(self.settings.meta)
        if self.resumed_extra is not None:  # a resumed run keeps its identity (run id, task, seed)
            meta.update({k: self.resumed_extra[k] for k in meta if k in self.resumed_extra})
        extra = {**meta, "loop": self.state_dict(), **{name: part.state_dict() for name, part in self.parts.items()}}
        cursor = self.task.cursor
        try:
            path = await trio.to_thread.run_sync(
                save_checkpoint, self.settings.checkpoint_dir, self.grpo, cursor, None, extra
            )
        except (OSError, ValueError) as exc:  # disk full, non-finite weights: logged, counted, retried
            self.faults["checkpoint_failures"] += 1
            self.checkpoint_retry = True
            log.error(
                "checkpoint v%d failed (%d so far), retried after the next step: %s",
                self.version,
                self.faults["checkpoint_failures"],
                exc,
            )
            return ""
        self.checkpoint_retry = False
        log.info(
            "checkpoint v%d (%d prompts pending) in %.2f s: %s",
            self.version,
            len(extra["buffer"].get("pending", [])),
            time.perf_counter() - t0,
            path,
        )
        return str(path)

    # --- evaluation ----------------------------------------------------------------------
    def evaluate(self, full: bool) -> dict[str, Any]:
        """The held-out evaluation (``full``: every held-out prompt, else the first
        ``eval_prompts``): ``eval_reward_sampled``, the mean task reward of one sampled completion
        (episode) per prompt with the run's seed (the same prompts and samples for the same
        weights; None between the first and the final evaluation of a task with an exact figure),
        and ``eval_reward``, the task's exact expected reward where it can compute one
        (``Task.exact_eval``, ``rl/exact_eval.py``), else the sampled figure. Runs in a worker thread."""
        from echorl.rl.exact_eval import ModelPolicy
        from echorl.tasks.env import is_episodic

        prompts = self.task.eval_prompts()
        if not full and self.settings.eval_prompts > 0:
            prompts = prompts[: self.settings.eval_prompts]
        seed = self.settings.seed + EVAL_SEED_OFFSET
        backend = self.eval_backend
        exact_eval = getattr(self.task, "exact_eval", None)
        sampled: float | None = None
        # Where the exact figure exists, the sampled one is taken only at the first and the final
        # evaluation: both at every eval doubled its cost, which the loop waits for (the demo:
        # ~70 evaluations of 1,024 prompts).
        if exact_eval is None or full or self.first_eval is None:
            t0 = time.perf_counter()
            if is_episodic(self.task):  # one sampled episode per held-out environment seed
                from echorl.actor.episodes import evaluate

                sampled = evaluate(backend, self.task, prompts, self.sampling_params(), seed)
            else:
                ids = [backend.encode(p.text) for p in prompts]
                samples = backend.sample_ids(ids, self.sampling_params(), seed=seed)
                sampled = sum(self.task.reward(p, s.text) for p, s in zip(prompts, samples)) / max(1, len(prompts))
            self.gen_samples_per_s = len(prompts) / max(1e-9, time.perf_counter() - t0)
        policy = ModelPolicy(backend, self.settings.temperature)
        exact = None if exact_eval is None else exact_eval(prompts, policy)
        extra = getattr(self.task, "exact_metrics", None)
        return {
            "eval_reward": sampled if exact is None else float(exact),
            "eval_reward_sampled": sampled,
            "eval_exact": exact is not None,
            "eval_prompts": len(prompts),
            **({} if extra is None else extra(prompts, policy)),
            **({} if self.self_play is None else {OPPONENT_TABLE: self.self_play.snapshot(policy)}),
        }

    async def _eval(self, full: bool) -> dict[str, Any]:
        t0 = time.perf_counter()
        ev = await trio.to_thread.run_sync(self.evaluate, full)
        table = ev.pop(OPPONENT_TABLE, None)
        if self.self_play is not None and table is not None:  # adopted between steps, on the event loop
            self.self_play.adopt(table)
            ev.update(self.self_play.metrics())  # self_play_snapshots, opponent_exploitability
        self.eval_s += time.perf_counter() - t0
        self.last_eval = ev["eval_reward"]
        if self.first_eval is None:
            self.first_eval = self.last_eval
        return ev

    # --- the loop ------------------------------------------------------------------------
    def open_metrics(self) -> None:
        if self.settings.metrics_out:
            mode = "a" if self.resumed_extra is not None else "w"
            self._metrics_file = open(self.settings.metrics_out, mode)  # noqa: SIM115 - closed in close()

    def close(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        for sink in self.sinks:
            sink.close()
        self.sinks = []
        self.grpo.close()  # with --nproc > 1: stops the worker ranks

    async def run(self, source: RolloutSource) -> None:
        """Train until ``settings.steps`` versions or ``stopping``. A new run evaluates at step 0
        (full held-out set); the last step evaluates on the full set too."""
        if self.resumed_extra is None:
            ev = await self._eval(full=True)
            c = self.buffer.counters()
            self._write(
                {
                    "step": 0,
                    "version": self.version,
                    "reward_mean": None,
                    **ev,
                    "rollouts_accepted": c["rollouts_accepted"],
                    "rollouts_rejected_stale": c["rollouts_rejected_stale"],
                    "staleness_step_max": 0,
                    "staleness_max": 0,
                    "staleness_mean": 0.0,
                    "busy_fraction": 0.0,
                    "elapsed_s": 0.0,
                }
            )
            log.info("step 0: eval_reward %.3f", ev["eval_reward"])
        self.started = time.monotonic()
        self._window = [time.monotonic(), 0]
        while not self.done:
            batch = self.buffer.take(self.settings.prompts_per_step, self.version)
            if batch is None:
                await source.wait()
                continue
            await self._step(source, batch)

    async def _step(self, source: RolloutSource, batch: list[RolloutGroup]) -> None:
        s = self.settings
        t = self.version
        for g in batch:
            if g.prompt_id in self.trained_prompt_ids:
                self.prompts_trained_twice += 1
            self.trained_prompt_ids[g.prompt_id] = None
        if self.t_first is None:
            self.t_first, self.eval_s_at_first = time.monotonic(), self.eval_s
        t0 = time.perf_counter()
        try:
            metrics = await trio.to_thread.run_sync(self.grpo.train_step, batch)
        except ValueError as exc:  # a batch that cannot be trained is dropped, never fatal
            log.warning("batch dropped: %s", exc)
            metrics = {"skipped": "invalid"}
        except DistributedError as exc:  # a worker rank died or hung: the run ends, rank 0 is intact
            self.failed = str(exc)
            self.stopping = True
            log.error("training stopped at v%d, a checkpoint follows: %s", t, exc)
            return
        if metrics.get("skipped"):
            why = str(metrics["skipped"])
            self.faults["train_steps_skipped_nonfinite" if why == "nonfinite" else "train_batches_dropped"] += 1
            source.step_skipped(batch, why)
            return
        t_train = float(metrics["train_seconds"])
        self.t_train_ema = t_train if self.t_train_ema == 0 else 0.8 * self.t_train_ema + 0.2 * t_train
        v = self.version
        final = v == s.steps
        if v % self.kappa == 0 or final:
            await self._publish(source, v)
        self.busy_s += time.perf_counter() - t0
        source.after_step()
        self._window[1] += len(batch)
        row = self._row(metrics, max(t - g.behaviour_version for g in batch))
        row.update(source.metrics())
        if v % max(1, s.eval_every) == 0 or final:
            row.update(await self._eval(full=final))
        self._write(row)
        self.summary = self._summary(row)
        if v % 10 == 0 or final:
            log.debug(
                "step %d: reward %.3f eval %s stale_max %d busy %.2f",
                v,
                row["reward_mean"],
                row["eval_reward"],
                row["staleness_max"],
                row["busy_fraction"],
            )
        if (
            s.checkpoint_dir
            and s.checkpoint_every > 0
            and (v % s.checkpoint_every == 0 or self.checkpoint_retry)
            and not final
        ):
            await self.checkpoint()
        if time.monotonic() - self._window[0] > 20:
            self._window = [time.monotonic(), 0]

    async def _publish(self, source: RolloutSource, version: int) -> None:
        """Hand the version to the source, unless a weight is non-finite (never published)."""
        from echorl.rl.grpo import state_dict_finite

        state = await trio.to_thread.run_sync(self.grpo.published_state)
        if await trio.to_thread.run_sync(state_dict_finite, state):
            await source.publish(version, state)
        else:
            self.faults["versions_withheld_nonfinite"] += 1
            log.error("v%d has non-finite weights: not published", version)

    def busy_fraction(self) -> float:
        """Time in GRPO steps and publication, over the wall time since the first batch minus
        the time spent evaluating (waiting for the first rollouts is start-up, not idleness)."""
        if self.t_first is None:
            return 0.0
        span = time.monotonic() - self.t_first - (self.eval_s - self.eval_s_at_first)
        return self.busy_s / max(1e-9, span)

    def _row(self, m: dict[str, Any], stale_step_max: int) -> dict[str, Any]:
        c = self.buffer.counters()
        return {
            "step": self.version,
            "version": int(m["version"]),
            "reward_mean": float(m["reward_mean"]),
            "eval_reward": None,
            "loss": float(m["loss"]),
            "train_seconds": float(m["train_seconds"]),
            "grad_norm": m.get("grad_norm"),
            "entropy": m.get("entropy"),
            "zero_var_group_frac": m.get("zero_var_group_frac"),
            "clip_frac": m.get("clip_frac"),
            "tis_frac": m.get("tis_frac"),
            "behaviour_mismatch": m.get("logp_abs_diff"),
            "staleness_step_max": stale_step_max,
            "staleness_max": int(c["staleness_max"]),
            "staleness_mean": float(c["staleness_mean"]),
            "rollouts_accepted": int(c["rollouts_accepted"]),
            "rollouts_rejected_stale": int(c["rollouts_rejected_stale"]),
            "rollouts_dropped_stale": int(c["rollouts_dropped_stale"]),
            "rollouts_per_s": self._window[1] / max(1e-9, time.monotonic() - self._window[0]),
            "publish_every": self.kappa,
            "t_train_s": self.t_train_ema,
            "busy_fraction": self.busy_fraction(),
            "prompts_trained_twice": self.prompts_trained_twice,
            "elapsed_s": time.monotonic() - self.started,
            "reward_errors": reward_errors(self.task),
            **self.faults,
        }

    SUMMARY_KEYS = (
        "step",
        "reward_mean",
        "staleness_max",
        "busy_fraction",
        "t_train_s",
        "t_bcast_s",
        "required_rollouts_per_s",
        "available_rollouts_per_s",
        "nodes_active",
        "nodes_standby",
        "activation",
        "activation_target_per_s",
        "elapsed_s",
    )

    def _summary(self, row: dict[str, Any]) -> dict[str, Any]:
        """The run's headline figures (the learner's status reply); always the newest eval."""
        out = {k: row[k] for k in self.SUMMARY_KEYS if k in row}
        out.update(eval_reward=self.last_eval, eval_reward_first=self.first_eval, steps_target=self.settings.steps)
        return out

    def _write(self, row: dict[str, Any]) -> None:
        """The one row goes to the JSONL file and to every sink."""
        self.last_row = row
        if self.rows is not None:
            self.rows.append(row)
        if self._metrics_file is not None:
            self._metrics_file.write(json.dumps(row) + "\n")
            self._metrics_file.flush()
        for sink in self.sinks:
            sink.write(row)


def _opt_float(x: float | None) -> float | None:
    return None if x is None else float(x)
