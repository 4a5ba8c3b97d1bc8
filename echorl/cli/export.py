"""``echorl export``: a trained checkpoint out as a Hugging Face model directory.

``echorl export --checkpoint DIR --out HF_DIR`` reads the newest checkpoint under ``DIR`` (a
``--checkpoint-dir``, or one ``v…`` directory in it), loads its base model (the directory its
``base.json`` names, or ``--model``) and writes ``HF_DIR``: for a LoRA checkpoint the adapter
merged into the base's weights (peft's ``merge_and_unload``), for a full fine-tuning checkpoint
its weights, each with the base's config, tokenizer and chat template. ``transformers`` loads the
result as it loads any model, and ``echorl train-local --model HF_DIR`` trains it further.

``--adapter-only`` writes a peft adapter directory instead (``adapter_config.json`` and
``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, HF_DIR)`` loads it).

Refused in one line (exit 2), before anything is written: a checkpoint that is not one, an
output that exists, a ``--model`` whose weights are not the base the adapter was trained on
(``actor/lora.py``'s base digest), ``--adapter-only`` on full weights. The directory appears
only when complete (written beside it, then renamed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

EXIT_BAD_INPUT = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a run's --checkpoint-dir, or one v… directory in it")
    p.add_argument("--out", required=True, help="Hugging Face model directory to create (must not exist)")
    p.add_argument("--adapter-only", action="store_true", help="write the LoRA adapter alone (peft's format)")
    p.add_argument("--model", default="", help="the base model directory (default: the one the checkpoint names)")


class ExportError(ValueError):
    """Input the export refuses: one line, exit 2."""


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        ckpt, base_dir = _inputs(Path(args.checkpoint), Path(args.out), args.model, args.adapter_only)
        info = export(ckpt, base_dir, Path(args.out), args.adapter_only)
    except ExportError as exc:
        print(f"echorl export: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    what = "adapter" if args.adapter_only else "model"
    print(f"wrote {args.out}: {what} of checkpoint v{info['version']} over {base_dir} ({info['bytes']:,} bytes)")
    return 0


def _inputs(checkpoint: Path, out: Path, model: str, adapter_only: bool) -> tuple[Any, Path]:
    """The checkpoint and its base directory, every refusal said before anything loads."""
    from echorl.actor import lora
    from echorl.rl.checkpoint import has_checkpoint, is_complete, load_checkpoint, read_checkpoint

    if out.exists():
        raise ExportError(f"{out} already exists; choose a new directory")
    if is_complete(checkpoint):  # one version's directory
        ckpt = read_checkpoint(checkpoint)
    elif has_checkpoint(checkpoint):
        ckpt = load_checkpoint(checkpoint)
    else:
        raise ExportError(f"{checkpoint} holds no complete checkpoint")
    record = ckpt.base
    named = model or record.get("base_model") or ""
    if not named:
        raise ExportError(f"{checkpoint} does not name its base model: pass --model DIR")
    base_dir = Path(named).expanduser()
    if not (base_dir / "config.json").is_file():
        raise ExportError(f"base model {base_dir} is not a Hugging Face model directory: pass --model DIR")
    adapter = record.get("lora")
    if adapter_only and adapter is None:
        raise ExportError(f"{checkpoint} holds full weights, not a LoRA adapter: export without --adapter-only")
    want = record.get("base_digest")
    if adapter is not None and want:
        try:
            have = lora.base_digest(base_dir).hex()
        except lora.LoraError as exc:
            raise ExportError(str(exc)) from None
        if have != want:
            raise ExportError(
                f"the adapter in {checkpoint} was trained on base model {want[:16]}, but {base_dir} is {have[:16]}"
            )
    return ckpt, base_dir


def export(ckpt: Any, base_dir: Path, out: Path, adapter_only: bool = False) -> dict[str, Any]:
    """Write the checkpoint's model (or adapter) into ``out``; returns its version and bytes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from echorl.actor import lora

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    settings = lora.LoraSettings.of(ckpt.base.get("lora"))
    if settings is not None:
        model = lora.attach(model, settings)
        try:
            lora.load_adapter(model, ckpt.model_state)
        except lora.LoraError as exc:
            raise ExportError(f"{ckpt.path}: {exc}") from None
        if not adapter_only:
            model = model.merge_and_unload()
    else:
        _load_full(model, ckpt.model_state)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if not adapter_only:
        AutoTokenizer.from_pretrained(base_dir, local_files_only=True).save_pretrained(tmp)
    tmp.rename(out)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return {"version": ckpt.version, "bytes": size}


def _load_full(model: Any, state: dict[str, Any]) -> None:
    """A full fine-tuning checkpoint's weights (a tied ``lm_head.weight`` may be left out)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ExportError(f"the checkpoint does not fit the base: missing {missing[:3]}, unexpected {unexpected[:3]}")
