"""Rollout throughput of the default tiny model: in-process sampling vs one node daemon over the network.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python bench/rollout_throughput.py --seconds 20 --steps 60 --json

Baseline (same run): ``TorchBackend.from_pretrained(default_model())`` in this process,
``generate(8 addition prompts, group_size=8, SamplingParams(temperature 1, top_p 1,
max_new_tokens=task.max_new_tokens))`` in a loop, for ``--seconds`` split into two halves, one
before and one after the network phase (to bracket load changes on the shared cores):
``inprocess_groups_per_s`` = groups / generate seconds.

Network: ``echorl learner`` and ONE ``echorl node`` as separate OS processes on 127.0.0.1
(as tests/swarm.py starts them), staleness ``--staleness`` (default 16, so the in-flight cap
16·(S−1) prompts does not pace a single node), small eval set and no periodic eval. From the
learner's metrics rows, after ``--warmup-steps``, over ``--steps`` learner steps:
``daemon_groups_per_s`` = Δ per_node_groups[node] / Δ elapsed_s (groups accepted by the learner
from that node per wall second, lease + generate + sign + submit + weight fetch included);
``node_generate_groups_per_s`` = the node's own generate-only rate (per_node_rollouts_per_s);
``learner_busy_frac`` = Σ train_seconds / Δ elapsed_s in the window. ``limited_by`` says which
side was the bottleneck. ``overhead_frac`` = 1 − daemon / in-process. All processes use
OMP_NUM_THREADS=1; ``loadavg`` is recorded because the 2 cores are shared with other work.
Prints one JSON line with ``--json``.

With ``--batching-rounds N`` (and ``--model DIR --task NAME``, e.g. SmolLM2 on ``arithmetic``) it
measures instead what batching buys a node: a lease's ``--lease-prompts`` × ``--group-size``
sequences sampled in one batched ``generate`` (left-padded, one KV cache, the prompt prefilled
once per sequence row) against the same sequences one at a time, in the same run, alternated:
``batched_tokens_per_s``, ``one_at_a_time_tokens_per_s`` (the baseline), ``batching_speedup``.
"""

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

from _report import emit

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def inprocess(backend, task, seconds: float) -> tuple[int, float]:
    from echorl.actor.types import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=int(task.max_new_tokens), stop=list(task.stop))
    groups, busy = 0, 0.0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        prompts = [p.text for p in task.next_prompts(8)]
        t = time.perf_counter()
        out = backend.generate(prompts, 8, params)
        busy += time.perf_counter() - t
        groups += len(out)
    return groups, busy


def batching(backend, task, lease_prompts: int, group_size: int, rounds: int) -> dict:
    """Tokens/s of a lease's sampling as the node does it (``lease_prompts`` × ``group_size``
    sequences in one batched ``generate``, one KV cache) against the same number of sequences
    drawn one at a time (batch 1, each its own prefill), alternated round by round."""
    from echorl.actor.types import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=int(task.max_new_tokens), stop=list(task.stop))
    batched, alone = [0, 0.0], [0, 0.0]  # tokens, seconds
    for _ in range(rounds):
        prompts = [p.text for p in task.next_prompts(lease_prompts)]
        t = time.perf_counter()
        groups = backend.generate(prompts, group_size, params)
        batched[1] += time.perf_counter() - t
        batched[0] += sum(len(x.token_ids) for g in groups for x in g)
        t = time.perf_counter()
        singles = [backend.generate([p], 1, params)[0][0] for p in prompts for _ in range(group_size)]
        alone[1] += time.perf_counter() - t
        alone[0] += sum(len(x.token_ids) for x in singles)
    per_s = batched[0] / batched[1], alone[0] / alone[1]
    return {
        "lease_prompts": lease_prompts,
        "group_size": group_size,
        "rounds": rounds,
        "batched_tokens_per_s": round(per_s[0], 1),
        "one_at_a_time_tokens_per_s": round(per_s[1], 1),
        "batching_speedup": round(per_s[0] / per_s[1], 2),
        "tokens_batched": batched[0],
        "tokens_one_at_a_time": alone[0],
    }


def spawn(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "echorl.cli", *args],
        env=ENV,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=str(ROOT),
    )


def rows(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def network(model_dir: str, args: argparse.Namespace, work: Path) -> dict:
    cfg = {
        "staleness": args.staleness,
        "eval_every": 10**6,
        "eval_prompts": 8,
        "model": model_dir,
        "metrics_out": str(work / "m.jsonl"),
        "addr_file": str(work / "addr"),
        "steps": 0,
    }
    (work / "learner.json").write_text(json.dumps(cfg))
    procs: list[subprocess.Popen] = []
    t_start = time.monotonic()
    try:
        learner = spawn(["learner", "--config", str(work / "learner.json")], work / "learner.log")
        procs.append(learner)
        while not (work / "addr").exists():
            if learner.poll() is not None or time.monotonic() - t_start > 90:
                raise RuntimeError("learner did not start:\n" + (work / "learner.log").read_text()[-2000:])
            time.sleep(0.1)
        addr = (work / "addr").read_text().strip()
        node = spawn(
            ["node", "--bootstrap", addr, "--key", str(work / "node.key"), "--model", model_dir], work / "node.log"
        )
        procs.append(node)
        target = args.warmup_steps + args.steps
        deadline = time.monotonic() + args.max_network_s
        while True:
            r = [x for x in rows(work / "m.jsonl") if x.get("step", 0) > 0]
            if r and r[-1]["step"] >= target:
                break
            if learner.poll() is not None or node.poll() is not None:
                raise RuntimeError(
                    "a process exited:\n"
                    + (work / "learner.log").read_text()[-1500:]
                    + (work / "node.log").read_text()[-1500:]
                )
            if time.monotonic() > deadline:
                break  # report what we have, marked truncated
            time.sleep(0.25)
    finally:
        stop(procs)
    r = [x for x in rows(work / "m.jsonl") if x.get("step", 0) > 0]
    if len(r) < 2:
        raise RuntimeError(
            "fewer than 2 learner steps:\n"
            + (work / "learner.log").read_text()[-1500:]
            + (work / "node.log").read_text()[-1500:]
        )
    a = r[min(args.warmup_steps, len(r) - 2) - 1] if args.warmup_steps > 0 else r[0]
    b = r[-1]
    (node_id,) = list(b["per_node_groups"])[:1] or [""]
    dt = b["elapsed_s"] - a["elapsed_s"]
    dg = b["per_node_groups"].get(node_id, 0) - a["per_node_groups"].get(node_id, 0)
    window = [x for x in r if a["step"] < x["step"] <= b["step"]]
    train = sum(x["train_seconds"] for x in window)
    return {
        "daemon_groups_per_s": dg / dt if dt > 0 else 0.0,
        "node_generate_groups_per_s": b.get("per_node_rollouts_per_s", {}).get(node_id),
        "learner_busy_frac": train / dt if dt > 0 else None,
        "learner_step_s": dt / max(1, b["step"] - a["step"]),
        "learner_train_s_mean": train / max(1, len(window)),
        "steps_measured": b["step"] - a["step"],
        "groups_measured": dg,
        "window_s": dt,
        "truncated": b["step"] < args.warmup_steps + args.steps,
        "staleness_max": b.get("staleness_max"),
        "rollouts_rejected_stale": b.get("rollouts_rejected_stale"),
        "leases_expired": b.get("leases_expired"),
        "rollouts_accepted": b.get("rollouts_accepted"),
        "network_phase_s": time.monotonic() - t_start,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="in-process sampling time (half before, half after)")
    ap.add_argument("--steps", type=int, default=60, help="learner steps measured")
    ap.add_argument("--warmup-steps", dest="warmup_steps", type=int, default=2)
    ap.add_argument("--staleness", type=int, default=16)
    ap.add_argument("--max-network-s", dest="max_network_s", type=float, default=110.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="a local model directory (default: the shipped tiny model)")
    ap.add_argument("--task", default="addition", help="prompts from this task, in the model's chat template")
    ap.add_argument(
        "--batching-rounds",
        dest="batching_rounds",
        type=int,
        default=0,
        help="instead of the phases above: N rounds of a lease sampled batched vs one sequence at a time",
    )
    ap.add_argument("--lease-prompts", dest="lease_prompts", type=int, default=2)
    ap.add_argument("--group-size", dest="group_size", type=int, default=8)
    args = ap.parse_args()
    t0 = time.monotonic()
    load_before = os.getloadavg()

    import torch

    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import default_model
    from echorl.tasks import load_task
    from echorl.tasks.chat import with_chat_template

    torch.set_num_threads(1)
    model_dir = str(args.model or default_model())
    backend = TorchBackend.from_pretrained(model_dir)
    task = with_chat_template(load_task(args.task), backend.tokenizer)
    if args.batching_rounds > 0:
        batching(backend, task, 1, 1, 1)  # warm-up
        out = {"bench": "rollout_throughput", "model": Path(model_dir).name, "task": args.task, "threads": 1}
        out.update(batching(backend, task, args.lease_prompts, args.group_size, args.batching_rounds))
        out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
        out["total_s"] = round(time.monotonic() - t0, 1)
        emit(out, args.json)
        return
    inprocess(backend, task, 1.0)  # warm-up
    g1, s1 = inprocess(backend, task, args.seconds / 2)
    load_mid = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="echorl-bench-") as tmp:
        net = network(model_dir, args, Path(tmp))
    load_mid2 = os.getloadavg()
    g2, s2 = inprocess(backend, task, args.seconds / 2)
    inproc = (g1 + g2) / (s1 + s2)
    out = {
        "bench": "rollout_throughput",
        "model": Path(model_dir).name,
        "task": args.task,
        "group_size": 8,
        "prompts_per_generate": 8,
        "max_new_tokens": int(task.max_new_tokens),
        "staleness": args.staleness,
        "inprocess_groups_per_s": round(inproc, 2),
        "inprocess_before_after": [round(g1 / s1, 2), round(g2 / s2, 2)],
        "daemon_groups_per_s": round(net.pop("daemon_groups_per_s"), 2),
    }
    out["overhead_frac"] = round(1 - out["daemon_groups_per_s"] / inproc, 3)
    busy = net["learner_busy_frac"] or 0.0
    if busy > 0.8:
        out["limited_by"] = "learner (train steps take most of the wall time; node paced by it)"
    else:
        out["limited_by"] = f"node (learner idle {1 - busy:.0%} of the window waiting for groups)"
    out.update({k: (round(v, 3) if isinstance(v, float) else v) for k, v in net.items()})
    out["loadavg"] = {
        "start": [round(x, 2) for x in load_before],
        "before_network": [round(x, 2) for x in load_mid],
        "after_network": [round(x, 2) for x in load_mid2],
        "end": [round(x, 2) for x in os.getloadavg()],
    }
    out["cpu_count"] = os.cpu_count()
    out["total_s"] = round(time.monotonic() - t0, 1)
    emit(out, args.json)


if __name__ == "__main__":
    main()
