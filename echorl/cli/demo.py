"""``echorl demo``: a learner and N node daemons as separate OS processes on 127.0.0.1, with the
default tiny model and the addition task (or ``--model DIR``, ``--task``); every published version
reaches the nodes through the pipelined broadcast (deltas, a full snapshot every ``--full-every``
publications); live progress, a clean stop (also on Ctrl-C) and a summary that names the
checkpoint directory and how to train on from it; ``--metrics-port`` serves the learner's
``/metrics`` meanwhile. The supervisor only starts, watches and stops processes; all work is in
the children. Its exit status is 0 after a complete run, also when the nodes leave on the
learner's run-end message before the learner process has exited."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from echorl.common import config
from echorl.common.config import MetricsPort, UploadMbps
from echorl.rl.advantages import DEFAULT_ADV_NORM, AdvNorm
from echorl.rl.config import FullEvery, LoraFields, PublishEvery, Staleness, Steps, TaskFields


class DemoConfig(LoraFields, TaskFields):
    """``echorl demo``: the settings of the swarm; the learner and every node get the model, seed,
    device, dtype, task and upload cap from here."""

    nodes: int = Field(3, ge=0, le=64)
    """node daemons to start (separate OS processes)"""
    steps: Steps = 700  # ~100 s on 2 cores; eval ≥ 0.70 for seeds 0–4 (docs/learning-notes.md)
    staleness: Staleness = 4
    metrics_out: str = Field("runs/demo-metrics.jsonl", min_length=1)
    """JSON line per learner step"""
    workdir: str = ""
    """keys, logs and the address file (default: a temp dir)"""
    publish_every: PublishEvery = 0
    full_every: FullEvery = 10
    upload_mbps: UploadMbps = 0.0
    metrics_port: MetricsPort = ""
    checkpoint_dir: str = ""
    """the learner's checkpoints (default: echorl-demo-<time>/checkpoints next to --metrics-out; the newest
    2 are kept); the summary says how to resume and extend the run from them"""
    adv_norm: AdvNorm = DEFAULT_ADV_NORM
    """the learner's group advantages: 'mean' or 'mean_std' (divided by the group's std too)"""
    learner_config: str = ""
    """TOML file of further learner settings (lr, group size, evaluation, …): the learner's
    --config; the demo's own flags win over it"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p, DemoConfig)


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONUNBUFFERED": "1",
    }
    return subprocess.Popen(
        [sys.executable, "-m", "echorl.cli", *args],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def _stop(procs: list[subprocess.Popen], timeout: float = 20.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class _Interrupts:
    """SIGTERM and SIGINT stop the swarm like Ctrl-C (``KeyboardInterrupt``), except while a child
    is being started: a signal then waits until the child is in the list that ``_stop`` ends, so
    no learner or node is ever orphaned."""

    def __init__(self) -> None:
        self.deferring = False
        self.pending = False

    def handle(self, signum: int, frame: Any) -> None:
        if self.deferring:
            self.pending = True
            return
        raise KeyboardInterrupt

    def spawn_into(self, procs: list[subprocess.Popen], args: list[str], log: Path) -> subprocess.Popen:
        self.deferring = True
        try:
            procs.append(_spawn(args, log))
        finally:
            self.deferring = False
        if self.pending:
            raise KeyboardInterrupt
        return procs[-1]


def run(ns: argparse.Namespace) -> int:
    args = config.configured(DemoConfig, ns, "demo")
    if isinstance(args, int):
        return args
    try:
        args.check_model()
        from echorl.common.metrics_sinks import sink_flags_error
        from echorl.tasks import load_task

        load_task(args.task, **args.task_options)  # a user's task that cannot run: one line now (TaskError)
        if problem := sink_flags_error(args.metrics_port):
            raise config.ConfigError(problem)
    except ValueError as exc:
        config.fail("demo", exc)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    interrupts = _Interrupts()
    signal.signal(signal.SIGTERM, interrupts.handle)
    signal.signal(signal.SIGINT, interrupts.handle)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="echorl-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    metrics = Path(args.metrics_out).resolve()
    metrics.parent.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.checkpoint_dir or metrics.parent / f"echorl-demo-{time.strftime('%Y%m%d-%H%M%S')}" / "checkpoints")
    if args.model:
        model_dir = Path(args.model).expanduser().resolve()
        print(f"echorl demo: model {model_dir}; logs in {work}", flush=True)
    else:
        print(f"echorl demo: built-in tiny model; logs in {work}", flush=True)
        from echorl.actor.model import default_model

        model_dir = default_model()
    addr_file = work / "learner.addr"
    addr_file.unlink(missing_ok=True)
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    try:
        learner = interrupts.spawn_into(
            procs, _learner_args(args, model_dir, metrics, addr_file, ckpt), work / "learner.log"
        )
        addr = _learner_address(learner, addr_file, work / "learner.log")
        if addr is None:
            return 1
        print(f"learner: {addr}\n  watch: echorl status --bootstrap {addr} --watch", flush=True)
        if args.metrics_port:
            print(f"  metrics: http://{_http_address(args.metrics_port)}/metrics", flush=True)
        for i in range(args.nodes):
            node = _node_args(args, model_dir, addr, work / f"node{i}.key")
            interrupts.spawn_into(procs, node, work / f"node{i}.log")
        _watch(learner, procs[1:], metrics, args.steps, t0)
        stopped = learner.poll() is None  # still running: its nodes failed, or it outlived its exit grace
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the swarm", flush=True)
        _stop(procs)
        return 130
    _stop(procs)
    return _summary(metrics, learner.returncode, stopped, time.monotonic() - t0, args, ckpt)


def _learner_args(args: DemoConfig, model_dir: Path, metrics: Path, addr_file: Path, ckpt: Path) -> list[str]:
    return [
        "learner",
        *("--steps", str(args.steps), "--staleness", str(args.staleness), "--seed", str(args.seed)),
        *("--model", str(model_dir), "--metrics-out", str(metrics), "--addr-file", str(addr_file)),
        *("--full-every", str(args.full_every), "--checkpoint-dir", str(ckpt)),
        *(["--publish-every", str(args.publish_every)] if args.publish_every else []),
        *(["--metrics-port", args.metrics_port] if args.metrics_port else []),
        *(["--upload-mbps", str(args.upload_mbps)] if args.upload_mbps else []),
        *("--task", args.task),
        *(a for k, v in args.task_options.items() for a in ("--task-option", f"{k}={v}")),
        *("--device", args.device, "--dtype", args.dtype, "--adv-norm", args.adv_norm),
        *(["--config", str(Path(args.learner_config).resolve())] if args.learner_config else []),
        *args.lora_flags(),
    ]


def _node_args(args: DemoConfig, model_dir: Path, addr: str, key: Path) -> list[str]:
    from echorl.tasks import BUILTIN

    return [
        "node",
        *("--bootstrap", addr, "--key", str(key), "--seed", str(args.seed), "--model", str(model_dir)),
        *("--device", args.device, "--dtype", args.dtype),
        *(["--upload-mbps", str(args.upload_mbps)] if args.upload_mbps else []),
        *([] if args.task in BUILTIN else ["--allow-env", args.task]),  # a user environment runs on our own nodes
    ]


def _http_address(metrics_port: str) -> str:
    return metrics_port if ":" in metrics_port else f"127.0.0.1:{metrics_port}"


def _learner_address(learner: subprocess.Popen, addr_file: Path, log: Path) -> str | None:
    """The learner's bootstrap address once it is up; None (after its last words) if it exits."""
    while not addr_file.exists():
        if learner.poll() is not None:
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            last = lines[-1] if lines else "(no output)"
            print(f"echorl demo: the learner exited (status {learner.returncode}): {last}; log: {log}", file=sys.stderr)
            return None
        time.sleep(0.1)
    return addr_file.read_text().strip()


LEARNER_EXIT_GRACE_S = 180.0  # after its nodes left on the run-end message: the final checkpoint, the summary


def _watch(learner: subprocess.Popen, nodes: list[subprocess.Popen], metrics: Path, steps: int, t0: float) -> None:
    """Print progress until the learner exits. Nodes that all exited 0 were told the run is over
    (the learner then still checkpoints and sums up: it gets ``LEARNER_EXIT_GRACE_S``); nodes that
    all failed end the watch at once."""
    last_step, ended_at = -1, None
    while learner.poll() is None:
        time.sleep(1.0)
        last_step = _progress(metrics, steps, last_step, t0)
        if not nodes or any(p.poll() is None for p in nodes):
            continue
        if any(p.returncode != 0 for p in nodes):
            print("all nodes exited, some with an error; see their logs", file=sys.stderr)
            return
        ended_at = ended_at or time.monotonic()
        if time.monotonic() - ended_at > LEARNER_EXIT_GRACE_S:
            print("the nodes were told the run is over, but the learner did not exit; stopping it", file=sys.stderr)
            return
    _progress(metrics, steps, last_step, t0)


def _progress(metrics: Path, steps: int, last_step: int, t0: float) -> int:
    """One line per new step in the metrics file; the newest step seen."""
    rows = _rows(metrics)
    if not rows or rows[-1].get("step", 0) == last_step:
        return last_step
    r = rows[-1]
    ev = next((x["eval_reward"] for x in reversed(rows) if x.get("eval_reward") is not None), None)
    reward = r.get("reward_mean")
    print(
        f"  step {r.get('step', 0):4d}/{steps}  reward {'-' if reward is None else f'{reward:.3f}'}  eval "
        f"{ev if ev is None else round(ev, 3)}  nodes {r.get('nodes_active', '-')}  "
        f"staleness_max {r.get('staleness_max', '-')}  {time.monotonic() - t0:.0f} s",
        flush=True,
    )
    return int(r.get("step", 0))


def _summary(metrics: Path, rc: int | None, stopped: bool, seconds: float, args: DemoConfig, ckpt: Path) -> int:
    """The closing lines; 0 iff every step was trained and the learner exited on its own, or was
    stopped only after that (its nodes had left on the run-end message)."""
    rows = _rows(metrics)
    evals = [r["eval_reward"] for r in rows if r.get("eval_reward") is not None]
    steps = [r for r in rows if r.get("step", 0) > 0]
    if not steps or not evals:
        print("no training steps recorded", file=sys.stderr)
        return 1
    last = steps[-1]
    contributing = sum(1 for v in last.get("per_node_groups", {}).values() if v > 0)
    required = last.get("required_rollouts_per_s")
    print(
        f"\nsummary: {last['step']} steps in {seconds:.0f} s; eval_reward {evals[0]:.3f} -> {evals[-1]:.3f}; "
        f"nodes contributing {contributing}/{args.nodes}; staleness_max {last['staleness_max']} (S={args.staleness}); "
        f"signatures verified {last['signatures_verified']}; leases expired {last['leases_expired']}; "
        f"throughput required {'-' if required is None else f'{required:.1f}'} vs available "
        f"{last['available_rollouts_per_s']:.1f} groups/s; metrics in {metrics}",
        flush=True,
    )
    print(f"broadcasts: {_broadcast_summary(steps)}", flush=True)
    complete = last["step"] >= args.steps
    if complete:
        print(
            f"checkpoint: {ckpt} (the newest 2 are kept); train on: echorl learner --resume --checkpoint-dir "
            f"{ckpt} --steps {2 * args.steps} (see README: after the demo)",
            flush=True,
        )
    _plot(metrics)
    return 0 if complete and (rc == 0 or stopped) else 1


def _plot(metrics: Path) -> None:
    """The run's figure next to its metrics file, when matplotlib (the ``plot`` extra) is here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot: skipped (pip install 'echorl[plot]' for a figure of the run)", flush=True)
        return
    from echorl.cli.plot import load_rows, plot

    print(f"plot: {plot({metrics.stem: load_rows(metrics)}, metrics.with_suffix('.png'))}", flush=True)


def _broadcast_summary(rows: list[dict[str, Any]]) -> str:
    """Per kind: count, median and max seconds, mean payload bytes (one entry per version seen)."""
    seen: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r.get("broadcast_version") is not None:
            seen[r["broadcast_version"]] = r
    parts = []
    for kind in ("full", "delta"):
        rs = [r for r in seen.values() if r.get("broadcast_kind") == kind]
        if rs:
            secs = sorted(r["broadcast_seconds"] for r in rs)
            size = sum(r.get("broadcast_bytes", 0) for r in rs) / len(rs)
            parts.append(
                f"{kind} x{len(rs)} median {secs[len(secs) // 2]:.3f} s max {secs[-1]:.3f} s {size / 1e6:.2f} MB"
            )
    return "; ".join(parts) or "none recorded"
