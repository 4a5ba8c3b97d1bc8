"""``echorl demo``: a learner and N node daemons as separate OS processes on 127.0.0.1, with the
default tiny model and the addition task (or ``--model DIR``, ``--task``); every published version reaches the nodes through the
pipelined broadcast (deltas, a full snapshot every ``--full-every`` publications); live progress,
a clean stop (also on Ctrl-C) and a summary. The supervisor only starts, watches and stops
processes; all work is in the children."""

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

from echorl import config
from echorl.config import ModelFields, UploadMbps
from echorl.learner.config import FullEvery, PublishEvery, Staleness, Steps, TaskFields


class DemoConfig(ModelFields, TaskFields):
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p, DemoConfig)


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "echorl.cli", *args], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


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
    if args.model:
        model_dir = Path(args.model).expanduser().resolve()
        print(f"echorl demo: model {model_dir}; logs in {work}", flush=True)
    else:
        print(f"echorl demo: built-in tiny model; logs in {work}", flush=True)
        from echorl.actor.model import default_model

        model_dir = default_model()
    task = ["--task", args.task, *(a for k, v in args.task_options.items() for a in ("--task-option", f"{k}={v}")),
            "--device", args.device, "--dtype", args.dtype]
    from echorl.tasks import BUILTIN

    allow = [] if args.task in BUILTIN else ["--allow-env", args.task]  # a user environment runs on our own nodes
    addr_file = work / "learner.addr"
    addr_file.unlink(missing_ok=True)
    t0 = time.monotonic()
    procs: list[subprocess.Popen] = []
    try:
        cap = ["--upload-mbps", str(args.upload_mbps)] if args.upload_mbps else []
        learner = interrupts.spawn_into(procs, ["learner", "--steps", str(args.steps), "--staleness", str(args.staleness), "--seed",
                          str(args.seed), "--model", str(model_dir), "--metrics-out", str(metrics),
                          "--addr-file", str(addr_file), "--full-every", str(args.full_every),
                          *(["--publish-every", str(args.publish_every)] if args.publish_every else []), *cap, *task],
                         work / "learner.log")
        while not addr_file.exists():
            if learner.poll() is not None:
                print((work / "learner.log").read_text()[-3000:], file=sys.stderr)
                return 1
            time.sleep(0.1)
        addr = addr_file.read_text().strip()
        print(f"learner: {addr}\n  status: echorl status --bootstrap {addr}", flush=True)
        for i in range(args.nodes):
            interrupts.spawn_into(procs, ["node", "--bootstrap", addr, "--key", str(work / f"node{i}.key"), "--seed",
                                          str(args.seed), "--model", str(model_dir), "--device", args.device,
                                          "--dtype", args.dtype, *cap, *allow], work / f"node{i}.log")
        last_step = -1
        while learner.poll() is None:
            time.sleep(1.0)
            rows = _rows(metrics)
            if rows and rows[-1].get("step", 0) != last_step:
                r = rows[-1]
                last_step = r.get("step", 0)
                ev = next((x["eval_reward"] for x in reversed(rows) if x.get("eval_reward") is not None), None)
                print(f"  step {last_step:4d}/{args.steps}  reward {r.get('reward_mean') or 0.0:.3f}  eval "
                      f"{ev if ev is None else round(ev, 3)}  nodes {r.get('nodes_active', '-')}  "
                      f"staleness_max {r.get('staleness_max', '-')}  {time.monotonic() - t0:.0f} s", flush=True)
            dead = [p for p in procs[1:] if p.poll() is not None]
            if len(dead) == args.nodes and args.nodes > 0:
                print("all nodes exited; see their logs", file=sys.stderr)
                break
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the swarm", flush=True)
        _stop(procs)
        return 130
    _stop(procs)
    return _summary(metrics, learner.returncode, time.monotonic() - t0, args)


def _summary(metrics: Path, rc: int | None, seconds: float, args: DemoConfig) -> int:
    rows = _rows(metrics)
    evals = [r["eval_reward"] for r in rows if r.get("eval_reward") is not None]
    steps = [r for r in rows if r.get("step", 0) > 0]
    if not steps or not evals:
        print("no training steps recorded", file=sys.stderr)
        return 1
    last = steps[-1]
    contributing = sum(1 for v in last.get("per_node_groups", {}).values() if v > 0)
    print(f"\nsummary: {last['step']} steps in {seconds:.0f} s; eval_reward {evals[0]:.3f} -> {evals[-1]:.3f}; "
          f"nodes contributing {contributing}/{args.nodes}; staleness_max {last['staleness_max']} (S={args.staleness}); "
          f"signatures verified {last['signatures_verified']}; leases expired {last['leases_expired']}; "
          f"required vs available rollouts/s {last['required_rollouts_per_s'] and round(last['required_rollouts_per_s'], 1)}"
          f" vs {round(last['available_rollouts_per_s'], 1)}; metrics in {metrics}", flush=True)
    print(f"broadcasts: {_broadcast_summary(steps)}", flush=True)
    _plot(metrics)
    return 0 if rc == 0 and last["step"] >= args.steps else 1


def _plot(metrics: Path) -> None:
    """The run's figure next to its metrics file, when matplotlib (the ``plot`` extra) is here."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot: skipped (pip install 'echorl[plot]' for a figure of the run)", flush=True)
        return
    from echorl.plot import load_rows, plot

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
            parts.append(f"{kind} x{len(rs)} median {secs[len(secs) // 2]:.3f} s max {secs[-1]:.3f} s "
                         f"{size / 1e6:.2f} MB")
    return "; ".join(parts) or "none recorded"
