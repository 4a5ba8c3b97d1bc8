"""Protocol-plane figures: snapshot encode/decode and chunk-verify throughput, delta ratios of a
real optimizer step, Ed25519 sign/verify rates, wire encode/decode rates.

    .venv/bin/python bench/protocol.py --size-mb 100 --json

Prints one JSON line. Baselines measured in the same run: raw SHA-256 and memcpy throughput
(what the snapshot path could at best approach), full size next to delta size.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from echorl.protocol import messages as m
from echorl.protocol import wire
from echorl.protocol.delta import apply_delta, encode_delta
from echorl.protocol.identity import Identity
from echorl.protocol.snapshot import (
    ChunkAssembler,
    build_manifest,
    digest,
    safetensors_to_state_dict,
    state_dict_to_safetensors,
    verify_result,
)


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def rate(fn, seconds=1.0) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - start)


def snapshot_figures(size_mb: int, identity: Identity) -> dict:
    n = size_mb * 2**20 // 4 // 1024
    state = {f"layer{i}.weight": torch.randn(1024, 64) for i in range(n // 64)}
    mb = sum(t.numel() * 4 for t in state.values()) / 2**20
    data, t_ser = timed(state_dict_to_safetensors, state)
    (manifest, chunks), t_man = timed(lambda: build_manifest(identity, "bench", 1, 0, data, data))
    assembler = ChunkAssembler(manifest)
    _, t_verify = timed(lambda: [assembler.add(r.digest, c) for r, c in zip(manifest.chunks, chunks)])
    payload = assembler.payload()
    _, t_result = timed(verify_result, manifest, payload)
    _, t_load = timed(safetensors_to_state_dict, payload)
    _, t_sha = timed(digest, data)
    _, t_copy = timed(bytearray, data)
    return {
        "state_dict_mb": round(mb, 1),
        "serialize_mb_s": round(mb / t_ser),
        "manifest_build_mb_s": round(mb / t_man),
        "chunk_verify_mb_s": round(mb / t_verify),
        "result_verify_mb_s": round(mb / t_result),
        "deserialize_mb_s": round(mb / t_load),
        "baseline_sha256_mb_s": round(mb / t_sha),
        "baseline_memcpy_mb_s": round(mb / t_copy),
    }


def delta_figures(dtype: torch.dtype, lr: float) -> dict:
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True), 4).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)

    def step():
        x = torch.randn(8, 16, 256, dtype=dtype)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    step()  # AdamW's first step moves every weight by ~lr; measure a steady-state step
    before = state_dict_to_safetensors(model.state_dict())
    step()
    after = state_dict_to_safetensors(model.state_dict())
    delta, t_enc = timed(encode_delta, before, after)
    rebuilt, t_dec = timed(apply_delta, before, delta)
    assert rebuilt == after
    mb = len(after) / 2**20
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "lr": lr,
        "full_bytes": len(after),
        "delta_bytes": len(delta),
        "delta_ratio": round(len(delta) / len(after), 4),
        "encode_mb_s": round(mb / t_enc),
        "apply_mb_s": round(mb / t_dec),
    }


def signature_figures(identity: Identity) -> dict:
    msg = b"x" * 200
    sig = identity.sign(msg)
    from echorl.protocol.identity import verify_signature

    lease = m.LeaseRequest(run_id="bench", version=1, max_prompts=16)
    data = wire.encode(lease)
    return {
        "sign_per_s": round(rate(lambda: identity.sign(msg))),
        "verify_per_s": round(rate(lambda: verify_signature(identity.public_key, msg, sig))),
        "wire_encode_per_s": round(rate(lambda: wire.encode(lease))),
        "wire_decode_per_s": round(rate(lambda: wire.decode(data))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=100, help="state dict size for the snapshot figures")
    parser.add_argument("--json", action="store_true", help="print one JSON line (default: also one line)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    identity = Identity.generate()
    out = {
        "bench": "protocol",
        **snapshot_figures(args.size_mb, identity),
        **signature_figures(identity),
        "delta": [
            delta_figures(torch.bfloat16, 1e-6),
            delta_figures(torch.bfloat16, 2e-4),
            delta_figures(torch.float32, 2e-4),
        ],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
