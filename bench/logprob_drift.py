"""Behaviour log-prob disagreement of a reduced-precision actor with the learner's float32 spot check.

    python bench/logprob_drift.py --json            # default model + 135M-class random Qwen3
    python bench/logprob_drift.py --json --skip-big # default model only

What a bf16/fp16 node reports vs what the learner recomputes: an actor (``TorchBackend``, KV-cached
left-padded sampling, temperature 1) runs on a copy of the weights cast to the dtype; the
learner's ``SpotChecker`` re-scores its completions from the float32 snapshot, exactly as in a
run. Printed per model and dtype: mean and max |Δ| over all completion tokens, and the float32
actor as the baseline (the same code path, no cast). These figures set the tolerance table of
``learner/tolerances.py`` (see docs/engines.md). CPU only: GPU kernels (and vLLM's) differ in
accumulation order, so ``scripts/gpu-check.sh`` measures the same thing on a GPU.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import emit


def drift(
    model_dir: Path, dtypes: list[str], prompts: int, group: int, new_tokens: int, seed: int, device: str = "cpu"
) -> dict:
    """{dtype: {mean_abs_diff, max_abs_diff, tokens, seconds}} for actors in each dtype on ``device``,
    all checked by a float32 CPU spot checker (the learner's configuration)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from echorl.actor.backend import TorchBackend
    from echorl.actor.types import RolloutGroup, SamplingParams
    from echorl.learner.spot_check import SpotChecker
    from echorl.protocol.snapshot import state_dict_to_safetensors

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    blob = state_dict_to_safetensors(ref.state_dict())
    checker = SpotChecker(ref, tok, 1.0, 1.0, lambda v: blob, tolerance_mean=1e9, tolerance_max=1e9, micro_batch=8)
    rng = random.Random(seed)
    texts = [f"{rng.randrange(100)}+{rng.randrange(100)}=" for _ in range(prompts)]
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    out = {}
    for dtype in dtypes:
        actor = TorchBackend(copy.deepcopy(ref).to(device=device, dtype=getattr(torch, dtype)), tok)
        t0 = time.perf_counter()
        samples = actor.generate(texts, group, params, seed=seed)
        groups = [RolloutGroup(f"p{i}", t, actor.encode(t), s, 0) for i, (t, s) in enumerate(zip(texts, samples))]
        res = checker.check_sync(groups, 0)
        out[dtype] = {
            "mean_abs_diff": round(res.mean_abs_diff, 6),
            "max_abs_diff": round(res.max_abs_diff, 6),
            "tokens": res.tokens,
            "seconds": round(time.perf_counter() - t0, 2),
        }
        del actor
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--skip-big", action="store_true", help="only the default model")
    ap.add_argument("--seeds", type=int, default=3, help="repeats (different prompts/samples) per model")
    args = ap.parse_args()

    import torch

    from echorl.actor.model import build_default_model, build_random_model

    torch.manual_seed(0)
    dtypes = ["float32", "bfloat16", "float16"]
    out: dict = {"bench": "logprob_drift", "baseline": "float32 actor (same sampling path, no cast)"}
    models = {"default": (build_default_model(), 16, 8, 12)}
    with tempfile.TemporaryDirectory(prefix="echorl-drift-") as tmp:
        if not args.skip_big:
            models["qwen3_135m_random"] = (build_random_model(Path(tmp) / "m135"), 4, 4, 16)
        for name, (path, prompts, group, new_tokens) in models.items():
            runs = [drift(path, dtypes, prompts, group, new_tokens, seed) for seed in range(args.seeds)]
            out[name] = {
                d: {
                    "mean_abs_diff": max(r[d]["mean_abs_diff"] for r in runs),
                    "max_abs_diff": max(r[d]["max_abs_diff"] for r in runs),
                    "tokens": sum(r[d]["tokens"] for r in runs),
                }
                for d in dtypes
            }
    emit(out, args.json)


if __name__ == "__main__":
    main()
