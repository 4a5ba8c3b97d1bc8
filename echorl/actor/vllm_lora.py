"""LoRA adapter versions on the vLLM engine (``VLLMBackend.with_adapter``), written against vLLM's
LoRA API and **UNTESTED against a real vLLM** (no GPU here; the official wheels are CUDA builds).

What it relies on (vLLM ``>=0.10.2,<0.13``): ``LLM(..., enable_lora=True, max_lora_rank=R,
max_loras=1)``; ``vllm.lora.request.LoRARequest(name, int_id, path)`` naming a peft adapter
directory (``adapter_config.json`` + ``adapter_model.safetensors``, peft's tensor names, which are
exactly an echorl adapter version's); ``LLM.generate(..., lora_request=...)``. vLLM caches a loaded
adapter by its integer id, so each version gets its own id (version + 1) and directory; the
directory of the version before is removed once a newer one is in use. What runs on the CPU is
tested: the directory written here is loaded by peft itself (tests/actor/test_vllm_lora.py).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .lora import LoraSettings

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def engine_kwargs(settings: LoraSettings) -> dict[str, Any]:
    """What ``vllm.LLM`` needs to serve this adapter (one at a time)."""
    return {"enable_lora": True, "max_lora_rank": int(settings.rank), "max_loras": 1}


def write_adapter_dir(out: Path, settings: LoraSettings, state_dict: Mapping[str, Any], base: str) -> Path:
    """A peft adapter directory for ``state_dict`` (an adapter version's tensors)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(settings.targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(out / WEIGHTS_FILE))
    return out


class AdapterSlot:
    """The adapter version an engine samples with: its request and its directory."""

    def __init__(self, settings: LoraSettings, base: str) -> None:
        self.settings, self.base = settings, base
        self.root = Path(tempfile.mkdtemp(prefix="echorl-vllm-lora-"))
        self.request: Any = None
        self._dir: Path | None = None

    def load(self, state_dict: Mapping[str, Any], version: int) -> None:
        from vllm.lora.request import LoRARequest  # type: ignore[import-not-found]

        new = write_adapter_dir(self.root / f"v{version}", self.settings, state_dict, self.base)
        self.request = LoRARequest(f"echorl-v{version}", version + 1, str(new))
        old, self._dir = self._dir, new
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
