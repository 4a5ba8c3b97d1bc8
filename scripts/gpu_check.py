"""The body of ``scripts/gpu-check.sh``: a prepared check of echorl on one GPU, nothing downloaded.

Steps (each reports its own figures or its error; one failing step does not stop the others):

1. ``torch_vs_cpu``: a torch actor on the device (dtype auto: bf16 on CUDA) samples from the
   default model and a 135M-class random Qwen3 built on the spot; the learner's float32 CPU spot
   checker re-scores them (mean/max |Δ|, and whether the tolerance row for that dtype passes).
2. ``vllm``: if vLLM imports and the device is CUDA: the vLLM engine samples, is updated in place
   with other weights, and its log-probs are re-scored by the spot checker before and after.
3. ``apply``: ``bench/apply.py``'s stages on the device for both models.
4. ``demo``: ``echorl demo --device DEVICE --steps N`` (a learner and 2 nodes), its last metrics line.
5. ``noise``: the seeded sampler's noise (``actor/seeded.py``) made on the device against the
   CPU's: the uniforms bit for bit, the Gumbel values' largest difference, and the tokens chosen
   from the same logits.
6. ``learner``: the trainer's update on the device in bf16 autocast (fp32 master weights,
   ``rl/precision.py``) and in fp32, each against the CPU fp32 trainer's (cosine of the change).
7. ``proofs``: the sampling replay's calibration (``bench/cheaters.py``) with honest nodes on the
   device (``fp32``, ``tf32``, ``bf16``) checked by a float32 CPU learner on the default model.
8. ``proofs_llm`` (``--llm DIR``, e.g. SmolLM2-135M-Instruct from ``echorl import-gguf``): the
   same on a real model and its chat-template task, learner and nodes both on the device, and
   the cheats a GPU makes cheap (another temperature or top-p, weights rounded to bf16).

Prints one summary JSON line (and writes it to ``--out`` if given); ``--lines FILE`` also
appends each step's result as it finishes (kept if the run is cut short). ``--device cpu`` runs every
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


LINES: Path | None = None
"""``--lines``: each step's result is appended here as it finishes."""


def step(summary: dict, name: str, fn, *args) -> None:
    t0 = time.perf_counter()
    try:
        summary[name] = fn(*args)
    except Exception as exc:
        traceback.print_exc()
        summary[name] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    summary[name]["seconds"] = round(time.perf_counter() - t0, 1)
    if LINES is not None:
        with LINES.open("a") as f:
            f.write(json.dumps({"step": name, **summary[name]}) + "\n")
    print(f"gpu-check: {name} done in {summary[name]['seconds']} s", file=sys.stderr, flush=True)


def noise_check(device: str) -> dict:
    import torch

    from echorl.actor.seeded import SeededRows, hash_bits, row_key, uniforms

    vocab, rows = 49_152, 64  # SmolLM2's vocabulary
    keys = [row_key(12345678901, i, t) for i in range(rows // 8) for t in range(8)]
    bits = [hash_bits(torch.tensor(keys, device=d), vocab) for d in ("cpu", device)]
    u = [uniforms(b) for b in bits]
    g = [-torch.log(-torch.log(x)) for x in u]
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab) * 3
    picks = []
    for d in ("cpu", device):
        sampler = SeededRows(987654321, list(range(rows)), [0] * rows, 4)
        picks.append([sampler.choose(logits.to(d), t, 1.0, p).cpu() for t in range(4) for p in (1.0, 0.9)])
    return {
        "hash_bits_equal": bool(torch.equal(bits[0], bits[1].cpu())),
        "uniforms_equal": bool(torch.equal(u[0], u[1].cpu())),
        "gumbel_max_abs_diff": float((g[0] - g[1].cpu()).abs().max()),
        "tokens_equal": all(torch.equal(a, b) for a, b in zip(picks[0], picks[1])),
        "tokens_compared": rows * len(picks[0]),
    }


def learner_check(device: str) -> dict:
    """Five GRPO steps at lr 1e-6 on the device, against the CPU float32 trainer."""
    import torch

    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import build_default_model
    from echorl.actor.types import RolloutGroup, SamplingParams
    from echorl.rl.grpo import GRPOConfig, GRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        path = build_default_model(Path(tmp) / "m", seed=0, warmup=None)
        backend = TorchBackend.from_pretrained(path)
        prompts = ["12+34=", "5+6=", "70+8=", "9+91="]
        out = backend.generate(prompts, 4, SamplingParams(max_new_tokens=6), seed=5)
        groups = [
            RolloutGroup(p, p, backend.encode(p), s, 0, [float(i % 2) + 0.5 * (i == 0) for i in range(len(s))])
            for p, s in zip(prompts, out)
        ]

        def update(dev: str, dtype: str) -> torch.Tensor:
            torch.manual_seed(0)
            trainer = GRPOTrainer(path, GRPOConfig(lr=1e-6, dtype=dtype, device=dev))
            before = [p.detach().double().cpu().clone() for p in trainer.model.parameters()]
            for _ in range(5):
                trainer.train_step(groups)
            after = [p.detach().double().cpu() for p in trainer.model.parameters()]
            return torch.cat([(a - b).flatten() for a, b in zip(after, before)])

        ref = update("cpu", "float32")
        res = {}
        for dtype in ("bfloat16", "float32"):
            got = update(device, dtype)
            res[f"cosine_{dtype}_vs_cpu_fp32"] = round(float(torch.nn.functional.cosine_similarity(got, ref, dim=0)), 5)
        return res


def proofs_check(
    device: str,
    model: Path | None,
    samples: int,
    cheat_leases: int,
    gaps_out: Path | None,
    seed: int = 0,
    kinds: tuple[str, ...] = ("bf16", "tf32", "fp32"),
    classes: tuple[str, ...] = ("temperature_0.7", "top_p_0.9", "bf16_weights", "other_model", "all_eos"),
    declare: str = "float32",
) -> dict:
    """``bench/cheaters.py`` with the honest engines on ``device``: the default model checked on
    the CPU, or ``model`` (with its chat-template task) checked on the device. ``gaps_out``: each
    honest submission's positions and gaps above 1e-4, as JSON (the data of a recalibration)."""
    import cheaters

    checker = "cpu" if model is None else device
    task = "addition" if model is None else "arithmetic"
    lab = cheaters.Lab(8, seed, str(model) if model else None, task, checker, device)
    leases = -(-samples // (8 * cheaters.G))
    curve: dict[str, list[float]] = {}
    out: dict = {"honest": [], "cheats": []}
    raw: dict[str, dict] = {}
    for kind in [k for k in kinds if device.startswith("cuda") or k != "tf32"]:
        curve[kind], submissions = [], []
        result = cheaters.run_honest(lab, kind, leases, curve[kind], submissions)
        out["honest"].append(result)
        raw[kind] = {"result": result, "submissions": submissions}
        if gaps_out is not None:  # after each engine: kept if the run is cut short
            gaps_out.write_text(json.dumps(raw))
    for name in classes if cheat_leases else ():
        gaps: list[float] = []
        out["cheats"].append(cheaters.run_class(lab, name, cheat_leases, gaps, declare))
        curve[name] = gaps
    out["curve_gap"] = list(cheaters.CURVE)
    out["position_miss_rate"] = cheaters.miss_rates(curve)
    return out


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
    ap.add_argument("--lines", default="", help="append each step's JSON result here as it finishes")
    ap.add_argument("--gaps-dir", default="", help="write each honest submission's replay gaps here (JSON)")
    ap.add_argument("--only", default="", help="comma-separated steps (default: all)")
    ap.add_argument("--llm", default="", help="an HF directory of a real model for proofs_llm")
    ap.add_argument("--proof-samples", type=int, default=10_000, help="samples per honest engine in proofs")
    ap.add_argument("--cheat-leases", type=int, default=20, help="leases per cheat class in proofs_llm")
    ap.add_argument("--proof-seed", type=int, default=0, help="proofs_llm's task order and lease seeds")
    ap.add_argument("--honest", default="bf16,tf32,fp32", help="proofs_llm's honest engines")
    ap.add_argument("--cheats", default="temperature_0.7,top_p_0.9,bf16_weights,other_model,all_eos")
    ap.add_argument("--declare", default="float32", help="the dtype proofs_llm's cheats declare")
    args = ap.parse_args()
    global LINES
    LINES = Path(args.lines) if args.lines else None
    wanted = set(args.only.split(",")) if args.only else None

    def gaps_file(name: str) -> Path | None:
        return Path(args.gaps_dir) / f"gaps_{name}.json" if args.gaps_dir else None

    def want(name: str) -> bool:
        return wanted is None or name in wanted

    import torch

    from echorl.actor.device import resolve_device
    from echorl.actor.model import QWEN3_135M, build_random_model, default_model

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
        needs_models = any(want(n) for n in ("torch_vs_cpu", "vllm", "apply"))
        models = {"default": default_model()}  # the shipped directory: nothing is trained here
        if needs_models:
            models["qwen3_135m_random"] = build_random_model(Path(tmp) / "m", arch)
        if want("noise"):
            step(summary, "noise", noise_check, device)
        if want("torch_vs_cpu"):
            step(summary, "torch_vs_cpu", torch_vs_cpu, models, device, dtype)
        if want("learner"):
            step(summary, "learner", learner_check, device)
        if want("proofs"):
            step(summary, "proofs", proofs_check, device, None, args.proof_samples, 0, gaps_file("proofs"))
        if want("proofs_llm") and args.llm:
            kinds, classes = tuple(args.honest.split(",")), tuple(args.cheats.split(","))
            llm_args = (Path(args.llm), args.proof_samples, args.cheat_leases, gaps_file("llm"), args.proof_seed)
            step(summary, "proofs_llm", proofs_check, device, *llm_args, kinds, classes, args.declare)
        try:
            import vllm  # noqa: F401

            has_vllm = device.startswith("cuda")
        except ImportError:
            has_vllm = False
        if has_vllm and want("vllm"):
            step(summary, "vllm", vllm_check, models["default"], dtype)
        elif want("vllm"):
            summary["vllm"] = {"skipped": "vllm not importable" if device.startswith("cuda") else "not a CUDA device"}
        if want("apply"):
            step(summary, "apply", apply_check, models, device)
        if not args.skip_demo and want("demo"):
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
