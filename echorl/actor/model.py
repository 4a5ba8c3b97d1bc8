"""The default model, made locally: no download at run time.

:func:`build_default_model` builds a tiny Qwen3-architecture causal LM from a config
(hidden 128, 2 layers, 4 heads / 2 KV heads, FFN 512, tied embeddings: ~0.5 M parameters), a
character-level tokenizer made with the ``tokenizers`` library, warms it up with a supervised
phase on 2-digit addition of a fixed number of steps, and saves a normal HF directory
(config.json, model.safetensors, tokenizer files) that ``AutoModelForCausalLM``/``AutoTokenizer``
load.

The warm-up is a fixed step count (not "until the probe accuracy reaches a target", not a time
budget): a target made the result depend on when a noisy probe crossed it, so two machines
built different models. It runs on one torch thread with fixed seeds, so a rebuild on the same
CPU is bit-identical. Different CPUs may still round differently, and this small model learns
addition through a sharp phase transition that amplifies such differences; so the model the
demo starts from is *shipped*: :func:`default_model` returns ``actor/default_model/`` (built by
``python -m echorl.actor.model --ship``; its marker records the weights' SHA-256, which the
tests compare with a rebuild). It is one model for every ``--seed``: the seed changes prompts
and sampling, not the start.

Other builds are cached: the directory carries ``echorl_model.json`` with a hash of everything
that determines it (architecture, warm-up settings, seed, builder version); a finished
directory with the same hash is reused. Builds are serialised with a file lock and written to
a temporary directory that is renamed into place, so concurrent callers are safe.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import string
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BUILDER_VERSION = 2
SHIPPED_DIR = Path(__file__).resolve().parent / "default_model"
SHIPPED_SEED = 0
MARKER = "echorl_model.json"
SPECIALS = ["<pad>", "</s>", "<unk>"]


@dataclass(frozen=True)
class TinyArch:
    """Architecture of the default model (a ``Qwen3Config``)."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    max_position_embeddings: int = 256


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised warm-up on ``digits``-digit addition (answer tokens + EOS are the targets):
    ``steps`` AdamW steps, learning rate ramped linearly over ``lr_warmup_steps`` then constant.
    The default stops in the middle of the model's phase transition on addition (sampled
    accuracy ~0.3, greedy ~0.5): GRPO has something to learn and the model is ready to."""

    digits: int = 2
    lr: float = 5e-3
    batch_size: int = 128
    steps: int = 800
    lr_warmup_steps: int = 20
    probe_size: int = 256


def build_char_tokenizer(vocab_size: int | None = None) -> Any:
    """A character-level ``PreTrainedTokenizerFast``: printable ASCII + newline, with
    ``<pad>`` (0), ``</s>`` (1, EOS) and ``<unk>`` (2). ``vocab_size`` pads the vocabulary with
    filler tokens ``<|tN|>`` so a random-weight model can have a realistic embedding size while
    every id it samples still decodes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    for i in range(len(vocab), vocab_size or 0):
        vocab[f"<|t{i}|>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def make_model(tokenizer: Any, arch: TinyArch, seed: int) -> Any:
    """A freshly initialised Qwen3ForCausalLM for ``tokenizer`` (deterministic per seed)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        head_dim=arch.hidden_size // arch.num_attention_heads,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **asdict(arch),
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg)


#: a SmolLM2-135M-sized Qwen3 (hidden 576, 30 layers, 9/3 heads, FFN 1536; with a 49152 vocabulary
#: ~134 M parameters): the "135M-class" model of the apply benchmark, the dtype measurement and
#: the GPU check, built with random weights on the spot (nothing downloaded).
QWEN3_135M = TinyArch(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    max_position_embeddings=2048,
)
QWEN3_135M_VOCAB = 49152


def build_random_model(
    out_dir: str | Path, arch: TinyArch = QWEN3_135M, vocab_size: int = QWEN3_135M_VOCAB, seed: int = 0
) -> Path:
    """A random-weight Qwen3 causal LM of ``arch`` with a padded character tokenizer, saved as an
    HF directory (fp32 safetensors). Not cached: it takes seconds, and what is measured on it
    (apply time, dtype disagreement) does not need trained weights."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = Path(out_dir)
    tokenizer = build_char_tokenizer(vocab_size)
    model = make_model(tokenizer, arch, seed).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def config_hash(arch: TinyArch, warmup: WarmupConfig | None, seed: int) -> str:
    blob = json.dumps(
        {"v": BUILDER_VERSION, "arch": asdict(arch), "warmup": warmup and asdict(warmup), "seed": seed},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_model_dir(seed: int = 0, arch: TinyArch = TinyArch(), warmup: WarmupConfig | None = WarmupConfig()) -> Path:
    """``$ECHORL_CACHE`` (default ``~/.cache/echorl``) / ``default-model-<hash>``."""
    root = Path(os.environ.get("ECHORL_CACHE") or Path.home() / ".cache" / "echorl")
    return root / f"default-model-{config_hash(arch, warmup, seed)}"


def is_finished(out_dir: Path, digest: str) -> bool:
    marker = out_dir / MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("hash") == digest
    except (OSError, json.JSONDecodeError):
        return False


def sampled_accuracy(model: Any, tokenizer: Any, pairs: list[tuple[int, int]], seed: int) -> float:
    """Fraction of ``a+b=`` prompts whose sampled (temperature 1) completion is the sum."""
    from .backend import TorchBackend
    from .types import SamplingParams

    backend = TorchBackend(model, tokenizer)
    ids = [backend.encode(f"{a}+{b}=") for a, b in pairs]
    params = SamplingParams(temperature=1.0, max_new_tokens=len(str(2 * max(max(p) for p in pairs))) + 2)
    samples = backend.sample_ids(ids, params, seed=seed)
    return sum(s.text.strip() == str(a + b) for s, (a, b) in zip(samples, pairs)) / len(pairs)


def warm_up(model: Any, tokenizer: Any, cfg: WarmupConfig, seed: int) -> dict[str, Any]:
    """The supervised phase: a fixed number of steps on training pairs (never held-out ones)."""
    import torch

    from echorl.tasks.addition import AdditionTask

    task = AdditionTask(digits=cfg.digits)  # its sample_pair never returns held-out pairs
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    t0 = time.perf_counter()
    model.train()
    for step in range(1, cfg.steps + 1):
        rows, targets = [], []
        for _ in range(cfg.batch_size):
            a, b = task.sample_pair(rng)
            p = tokenizer(f"{a}+{b}=", add_special_tokens=False)["input_ids"]
            c = tokenizer(str(a + b), add_special_tokens=False)["input_ids"] + [eos]
            rows.append(p + c)
            targets.append([-100] * len(p) + c)
        width = max(map(len, rows))
        ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        lab = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
        att = torch.arange(width)[None, :] < torch.tensor([len(r) for r in rows])[:, None]
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, step / max(1, cfg.lr_warmup_steps))
        loss = model(input_ids=ids, attention_mask=att.long(), labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    seconds = round(time.perf_counter() - t0, 2)
    model.eval()
    probe = [task.sample_pair(random.Random(10_000 + i)) for i in range(cfg.probe_size)]
    return {"steps": cfg.steps, "probe_accuracy": sampled_accuracy(model, tokenizer, probe, seed), "seconds": seconds}


def weights_digest(model_dir: Path) -> str:
    """SHA-256 of a model directory's ``model.safetensors``."""
    return hashlib.sha256((Path(model_dir) / "model.safetensors").read_bytes()).hexdigest()


def default_model() -> Path:
    """The model the demo, the learner, nodes and train-local start from when no ``--model``
    is given: the shipped directory, or (if it is missing or was built by other settings than
    this code's defaults) a cached build with those settings."""
    if is_finished(SHIPPED_DIR, config_hash(TinyArch(), WarmupConfig(), SHIPPED_SEED)):
        return SHIPPED_DIR
    return build_default_model(seed=SHIPPED_SEED)


def build_default_model(
    out_dir: str | Path | None = None,
    seed: int = 0,
    arch: TinyArch = TinyArch(),
    warmup: WarmupConfig | None = WarmupConfig(),
) -> Path:
    """Build (or reuse) the default model and return its directory.

    ``out_dir`` None means :func:`default_model_dir`. ``warmup=None`` skips the supervised
    phase (an untrained model: useful for fast tests).
    """
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    digest = config_hash(arch, warmup, seed)
    out = Path(out_dir) if out_dir is not None else default_model_dir(seed, arch, warmup)
    if is_finished(out, digest):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_finished(out, digest):
            return out
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            tokenizer = build_char_tokenizer()
            model = make_model(tokenizer, arch, seed)
            info = warm_up(model, tokenizer, warmup, seed) if warmup else {"steps": 0}
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
            model.eval()
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            marker = {
                "hash": digest,
                "seed": seed,
                "arch": asdict(arch),
                "sha256": weights_digest(tmp),
                "warmup": warmup and asdict(warmup),
                "warmup_result": info,
                "parameters": sum(p.numel() for p in model.parameters()),
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=1))
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
        finally:
            torch.set_num_threads(threads)
    return out


def _main() -> None:
    import argparse

    p = argparse.ArgumentParser(description="Build the default model (python -m echorl.actor.model).")
    p.add_argument("--ship", action="store_true", help=f"rebuild the shipped model into {SHIPPED_DIR}")
    p.add_argument("--out", default=None, help="build into this directory instead")
    args = p.parse_args()
    out = SHIPPED_DIR if args.ship else args.out
    if out is not None and Path(out).exists():
        shutil.rmtree(out)
    built = build_default_model(out, seed=SHIPPED_SEED)
    print(json.dumps(json.loads((built / MARKER).read_text())))


if __name__ == "__main__":
    _main()
