"""The body of ``scripts/gpu-check.sh``: a prepared check of echorl on one GPU, nothing downloaded.

Steps (each reports its own figures or its error; one failing step does not stop the others):

1. ``torch_vs_cpu``: a torch actor on the device (dtype auto: bf16 on CUDA) samples from the
   default model and a 135M-class random Qwen3 built on the spot; the learner's float32 CPU spot
   checker re-scores them (mean/max |Δ|, and whether the tolerance row for that dtype passes).
2. ``vllm``: if vLLM imports and the device is CUDA: the vLLM engine samples, is updated in place
   with other weights, and its log-probs are re-scored by the spot checker before and after.
3. ``apply``: ``bench/apply.py``'s stages on the device for both models.
4. ``demo``: ``echorl demo --device DEVICE --steps N`` (a learner and 2 nodes), its last metrics line.

Prints one summary JSON line (and writes it to ``--out`` if given). ``--device cpu`` runs every
step but vLLM on the CPU (with ``--small``: a 4-layer variant of the 135M model), which is how
the script itself is tested where there is no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def step(summary: dict, name: str, fn, *args) -> None:
    t0 = time.perf_counter()
    try:
        summary[name] = fn(*args)
    except Exception as exc:
        traceback.print_exc()
        summary[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    summary[name]["seconds"] = round(time.perf_counter() - t0, 1)


def torch_vs_cpu(models: dict[str, Path], device: str, dtype: str) -> dict:
    from logprob_drift import drift

    from echorl.learner.tolerances import Tolerance, tolerance_for

    tol = tolerance_for("torch", dtype, Tolerance(0.02, 0.5))
    out = {}
    for name, path in models.items():
        d = drift(path, [dtype], prompts=8, group=4, new_tokens=16, seed=0, device=device)[dtype]
        d["passes_tolerance"] = d["mean_abs_diff"] <= tol.mean and d["max_abs_diff"] <= tol.max
        out[name] = d
    return out


def vllm_check(path: Path, dtype: str) -> dict:
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from echorl.actor.types import RolloutGroup, SamplingParams
    from echorl.actor.vllm_backend import VLLMBackend
    from echorl.learner.spot_check import SpotChecker
    from echorl.protocol.snapshot import state_dict_to_safetensors

    ref = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    engine = VLLMBackend(path, 0.3, dtype=dtype, seed=0, max_model_len=256, enforce_eager=False)
    out: dict = {"start_s": round(time.perf_counter() - t0, 1)}
    texts = [f"{i}+{2 * i}=" for i in range(8)]
    params = SamplingParams(temperature=1.0, max_new_tokens=16)

    def score(state_dict: dict, tag: str) -> None:
        blob = state_dict_to_safetensors(state_dict)
        checker = SpotChecker(copy.deepcopy(ref), engine.tokenizer, 1.0, 1.0, lambda v: blob)
        t = time.perf_counter()
        samples = engine.generate(texts, 4, params, seed=1)
        out[f"{tag}_generate_s"] = round(time.perf_counter() - t, 3)
        groups = [RolloutGroup(f"p{i}", x, engine.encode(x), s, 0) for i, (x, s) in enumerate(zip(texts, samples))]
        res = checker.check_sync(groups, 0, "vllm", dtype)
        out[tag] = {
            "mean_abs_diff": round(res.mean_abs_diff, 5),
            "max_abs_diff": round(res.max_abs_diff, 5),
            "tokens": res.tokens,
            "passes_tolerance": res.ok,
        }

    score(ref.state_dict(), "before_update")
    torch.manual_seed(1)
    new = {k: v + 0.02 * torch.randn_like(v) for k, v in ref.state_dict().items()}
    if "lm_head.weight" in new and "model.embed_tokens.weight" in new and ref.config.tie_word_embeddings:
        new["lm_head.weight"] = new["model.embed_tokens.weight"]
    t = time.perf_counter()
    engine.load_state_dict(new, 1)
    out["update_s"] = round(time.perf_counter() - t, 3)
    ref.load_state_dict(new)
    score(new, "after_update")
    return out


def apply_check(models: dict[str, Path], device: str) -> dict:
    from apply import bench_model

    return {name: bench_model(path, device, None, 2) for name, path in models.items()}


def demo(device: str, steps: int, workdir: Path) -> dict:
    metrics = workdir / "demo.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "echorl.cli",
        "demo",
        "--device",
        device,
        "--steps",
        str(steps),
        "--nodes",
        "2",
        "--metrics-out",
        str(metrics),
        "--workdir",
        str(workdir / "demo"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    last = json.loads(lines[-1]) if lines else {}
    keep = (
        "step",
        "version",
        "eval_reward",
        "reward_mean",
        "rollouts_accepted",
        "spot_checks",
        "rollouts_rejected_logprob",
        "spot_check_passed_max_abs_diff",
    )
    return {
        "rc": proc.returncode,
        "steps_logged": len(lines),
        **{k: last[k] for k in keep if k in last},
        "stderr_tail": proc.stderr[-300:] if proc.returncode else "",
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--small", action="store_true", help="a 4-layer variant of the 135M model (CPU runs)")
    ap.add_argument("--skip-demo", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import torch

    from echorl.actor.device import resolve_device
    from echorl.actor.model import QWEN3_135M, build_default_model, build_random_model

    device, dtype = resolve_device(args.device)
    summary: dict = {
        "check": "gpu",
        "device": device,
        "dtype": dtype,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="echorl-gpucheck-") as tmp:
        arch = replace(QWEN3_135M, num_hidden_layers=4) if args.small else QWEN3_135M
        models = {"default": build_default_model(), "qwen3_135m_random": build_random_model(Path(tmp) / "m", arch)}
        step(summary, "torch_vs_cpu", torch_vs_cpu, models, device, dtype)
        try:
            import vllm  # noqa: F401

            has_vllm = device.startswith("cuda")
        except ImportError:
            has_vllm = False
        if has_vllm:
            step(summary, "vllm", vllm_check, models["default"], dtype)
        else:
            summary["vllm"] = {"skipped": "vllm not importable" if device.startswith("cuda") else "not a CUDA device"}
        step(summary, "apply", apply_check, models, device)
        if not args.skip_demo:
            step(summary, "demo", demo, device, args.steps, Path(tmp))
    summary["total_s"] = round(time.perf_counter() - t0, 1)
    line = json.dumps(summary)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    failed = [k for k, v in summary.items() if isinstance(v, dict) and ("error" in v or v.get("rc", 0))]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
