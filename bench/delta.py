"""Delta size: delta bytes / full bytes of consecutive published versions (protocol/delta.py).

    python bench/delta.py --json                 # demo model, 20 versions + ~100 M model, 1 step

1. The demo model (Qwen3 architecture from TinyArch, 495 k parameters, fp32), trained with
   AdamW at the demo's GRPO learning rate (2e-4) for 20 consecutive optimizer steps (one step =
   one version) on the language-model loss of addition strings: the ratio per version for the
   fp32 snapshot (what the demo publishes) and for the same weights cast to bf16.
2. A ~100 M-parameter Qwen3 model: fp32 master weights, one real AdamW step (lr 1e-6, a usual
   RL post-training rate; and 2e-4), published as bf16 and as fp32.

Prints one JSON line (and a table without ``--json``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echorl.protocol.delta import apply_delta, encode_delta
from echorl.protocol.snapshot import state_dict_to_safetensors


def snapshot(model, dtype=None) -> bytes:
    sd = model.state_dict()
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return state_dict_to_safetensors(sd)


def ratio(old: bytes, new: bytes) -> float:
    d = encode_delta(old, new)
    assert apply_delta(old, d) == new  # bit-exact
    return len(d) / len(new)


def addition_batch(tok, n: int, rng: random.Random):
    texts = [f"{a}+{b}={a + b}" for a, b in ((rng.randrange(100), rng.randrange(100)) for _ in range(n))]
    enc = tok(texts, return_tensors="pt", padding=True)
    labels = enc["input_ids"].clone()
    labels[enc["attention_mask"] == 0] = -100
    return enc["input_ids"], enc["attention_mask"], labels


def demo_series(versions: int, lr: float) -> dict:
    import torch

    from echorl.actor.model import TinyArch, build_char_tokenizer, make_model

    torch.manual_seed(0)
    tok = build_char_tokenizer()
    model = make_model(tok, TinyArch(), seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(0)
    prev32, prev16 = snapshot(model), snapshot(model, torch.bfloat16)
    r32, r16 = [], []
    for _ in range(versions):
        ids, att, labels = addition_batch(tok, 16, rng)
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        cur32, cur16 = snapshot(model), snapshot(model, torch.bfloat16)
        r32.append(round(ratio(prev32, cur32), 4))
        r16.append(round(ratio(prev16, cur16), 4))
        prev32, prev16 = cur32, cur16
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "lr": lr,
        "full_bytes_fp32": len(prev32),
        "ratios_fp32": r32,
        "ratios_bf16": r16,
        "mean_fp32": round(sum(r32) / len(r32), 4),
        "mean_bf16": round(sum(r16) / len(r16), 4),
    }


def big_step(lrs: list[float]) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=32000,
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=6,
        head_dim=64,
        intermediate_size=2048,
        tie_word_embeddings=True,
        max_position_embeddings=512,
    )
    out: dict = {}
    for lr in lrs:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        before32, before16 = snapshot(model), snapshot(model, torch.bfloat16)
        ids = torch.randint(0, cfg.vocab_size, (2, 64))
        t = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        step_s = time.perf_counter() - t
        after32, after16 = snapshot(model), snapshot(model, torch.bfloat16)
        t = time.perf_counter()
        r16 = ratio(before16, after16)
        enc_s = time.perf_counter() - t
        out[f"lr={lr:g}"] = {
            "bf16": round(r16, 4),
            "fp32": round(ratio(before32, after32), 4),
            "full_bytes_bf16": len(after16),
            "step_s": round(step_s, 1),
            "encode_apply_bf16_s": round(enc_s, 1),
        }
        out["params"] = sum(p.numel() for p in model.parameters())
        del model, opt, before32, after32, before16, after16
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--versions", type=int, default=20)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--big-lr", type=float, action="append", default=None)
    ap.add_argument("--skip-big", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    out = {"demo": demo_series(args.versions, args.lr)}
    if not args.skip_big:
        out["model_100m"] = big_step(args.big_lr or [1e-6, 2e-4])
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
