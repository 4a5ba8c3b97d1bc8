"""Data-parallel GRPO step time: ``DistributedGRPO`` on N ranks against one ``GRPOTrainer``
(the baseline, same model, same batches, measured in the same run).

    python bench/data_parallel.py --json                       # demo model, 2 ranks, CPU
    python bench/data_parallel.py --nproc 4 --model DIR --rows 256 --device cuda --json

Synthetic rollout groups (random tokens, behaviour log-probs off the policy) of ``--group-size``
samples, ``--rows`` sequences per step, completions of 8..``--max-len`` tokens. Reports the
median seconds per step of each, the speed-up, and the relative difference of the final
weights (the two runs train the same batches, so it must stay near float rounding). Each rank
uses ``--threads`` intra-op threads; a speed-up needs N × threads free cores (or N GPUs).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench._report import emit


def batches(vocab: int, steps: int, rows: int, group: int, max_len: int, seed: int) -> list:
    from echorl.actor.types import RolloutGroup, Sample

    rng = random.Random(seed)
    out = []
    for step in range(steps):
        groups = []
        for g in range(max(1, rows // group)):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 16))]
            samples = []
            for _ in range(group):
                ids = [rng.randrange(vocab) for _ in range(rng.randint(8, max_len))]
                samples.append(Sample(ids, [rng.uniform(-6.0, -2.0) for _ in ids], "length", ""))
            groups.append(
                RolloutGroup(f"p{step}-{g}", "", prompt, samples, step, [float(rng.random() < 0.5) for _ in samples])
            )
        out.append(groups)
    return out


def timed(trainer, data: list) -> list[float]:
    times = []
    for b in data:
        t0 = time.perf_counter()
        trainer.train_step(b)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--model", default="", help="HF model directory (default: the demo model, untrained)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=48)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import torch

    from echorl.actor.model import build_default_model
    from echorl.rl.distributed import DistributedGRPO
    from echorl.rl.grpo import GRPOConfig, GRPOTrainer

    torch.set_num_threads(a.threads)
    model = a.model or str(build_default_model(Path("/tmp/echorl-bench-dp-model"), seed=0, warmup=None))
    cfg = GRPOConfig(lr=1e-4, micro_batch=a.micro_batch, device=a.device)
    one = GRPOTrainer(model, cfg)
    data = batches(int(one.model.config.vocab_size), a.steps + 1, a.rows, a.group_size, a.max_len, 0)
    base = timed(one, data)[1:]  # the first step warms up allocators and kernels
    many = GRPOTrainer(model, cfg)
    with DistributedGRPO(many, model, a.nproc, threads=a.threads) as dp:
        dist = timed(dp, data)[1:]
        in_sync = dp.ranks_in_sync()
    ref, got = one.state_dict(), many.state_dict()
    rel = max(float((ref[k] - got[k]).norm()) / max(1e-12, float(ref[k].norm())) for k in ref)
    b, d = statistics.median(base), statistics.median(dist)
    emit(
        {
            "bench": "data_parallel",
            "model": model,
            "device": a.device,
            "nproc": a.nproc,
            "threads": a.threads,
            "rows_per_step": sum(len(g.samples) for g in data[0]),
            "steps": a.steps,
            "baseline_1rank_s_per_step": round(b, 4),
            "nproc_s_per_step": round(d, 4),
            "speedup": round(b / d, 3),
            "final_weights_max_rel_diff": rel,
            "ranks_in_sync": in_sync,
        },
        a.json,
    )


if __name__ == "__main__":
    main()
