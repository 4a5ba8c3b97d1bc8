"""Apply latency: from a version's last chunk to the engine sampling with it.

    python bench/apply.py --json                   # default model + 135M-class random Qwen3, CPU torch
    python bench/apply.py --json --model DIR       # also any local HF directory, e.g. SmolLM2-135M made by
                                                   # `echorl import-gguf` (see `make smoke-gguf`)
    python bench/apply.py --json --device cuda     # on a GPU (scripts/gpu-check.sh)

What a node does when the last chunk of a full version arrives (``node/versions.py``): check that
chunk against the signed manifest, join the payload, verify the rebuilt file (whole digest and
per-tensor digests), deserialise it (``safetensors_to_state_dict``), copy it into the running
engine (``load_state_dict``, no rebuild), and sample the first token. Each stage is timed
(median of ``--repeats``) and the total is compared with the baseline measured in the same run:
the raw ``safetensors.torch.load`` of the same bytes, the least any node must spend.

Prints one JSON line: per model, parameters, bytes, each stage's seconds, apply_s, baseline_s and
apply_over_baseline.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import emit

STAGES = ("last_chunk_s", "join_s", "verify_s", "deserialise_s", "load_state_dict_s", "first_token_s")


def apply_once(backend, manifest, chunks: list[bytes], version: int) -> dict[str, float]:
    """One version applied from scratch (all chunks but the last already held)."""
    from echorl.actor.types import SamplingParams
    from echorl.protocol import snapshot

    asm = snapshot.ChunkAssembler(manifest)
    for ref, data in zip(manifest.chunks[:-1], chunks[:-1]):
        asm.add(ref.digest, data)
    t = {}
    t0 = time.perf_counter()
    asm.add(manifest.chunks[-1].digest, chunks[-1])
    t1 = time.perf_counter()
    payload = asm.payload()
    t2 = time.perf_counter()
    snapshot.verify_result(manifest, payload)
    t3 = time.perf_counter()
    sd = snapshot.safetensors_to_state_dict(payload)
    t4 = time.perf_counter()
    backend.load_state_dict(sd, version)
    t5 = time.perf_counter()
    backend.generate(["12+34="], 1, SamplingParams(temperature=1.0, max_new_tokens=1), seed=version)
    t6 = time.perf_counter()
    for name, (a, b) in zip(STAGES, [(t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5), (t5, t6)]):
        t[name] = b - a
    return t


def bench_model(path: Path, device: str, dtype: str | None, repeats: int) -> dict:
    import safetensors.torch
    import torch

    from echorl.actor.backend import TorchBackend
    from echorl.actor.types import SamplingParams
    from echorl.protocol import snapshot
    from echorl.protocol.identity import Identity

    backend = TorchBackend.from_pretrained(path, device=device, dtype=dtype)
    identity = Identity.generate()
    backend.generate(["1+1="], 1, SamplingParams(temperature=1.0, max_new_tokens=1), seed=0)  # warm-up, untimed
    runs, base = [], []
    for v in range(1, repeats + 1):
        with torch.no_grad():
            sd = {k: p + 1e-3 * v for k, p in backend.model.state_dict().items()}  # a different version each time
        blob = snapshot.state_dict_to_safetensors(sd)
        del sd
        manifest, chunks = snapshot.build_manifest(identity, "bench", v, v - 1, blob, blob)
        runs.append(apply_once(backend, manifest, chunks, v))
        t0 = time.perf_counter()
        safetensors.torch.load(blob)
        base.append(time.perf_counter() - t0)
    out: dict = {
        "parameters": sum(p.numel() for p in backend.model.parameters()),
        "bytes": len(blob),
        "dtype": str(next(backend.model.parameters()).dtype).removeprefix("torch."),
    }
    for name in STAGES:
        out[name] = round(statistics.median(r[name] for r in runs), 4)
    out["apply_s"] = round(statistics.median(sum(r.values()) for r in runs), 4)
    out["baseline_s"] = round(statistics.median(base), 4)
    out["apply_over_baseline"] = round(out["apply_s"] / max(out["baseline_s"], 1e-9), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="engine weight dtype (default: the model's, float32)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-big", action="store_true", help="no 135M-class random model")
    ap.add_argument("--model", action="append", default=[], help="also this local HF directory (repeatable)")
    args = ap.parse_args()

    from echorl.actor.device import resolve_device
    from echorl.actor.model import build_default_model, build_random_model

    device, _ = resolve_device(args.device)
    out: dict = {"bench": "apply", "device": device, "baseline": "safetensors.torch.load of the same bytes (same run)"}
    with tempfile.TemporaryDirectory(prefix="echorl-apply-") as tmp:
        models = {"default": build_default_model()}
        if not args.skip_big:
            models["qwen3_135m_random"] = build_random_model(Path(tmp) / "m135")
        models.update({Path(m).name: Path(m) for m in args.model})
        for name, path in models.items():
            out[name] = bench_model(path, device, args.dtype, args.repeats)
    emit(out, args.json)


if __name__ == "__main__":
    main()
