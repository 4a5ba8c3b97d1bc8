"""LoRA adapters (peft) for every role: the learner trains one, nodes and spot checks apply each
published adapter version to a frozen base, ``echorl export`` merges one into a model directory.

- :class:`LoraSettings`: rank, alpha, dropout, target modules (``--lora-rank 0``: full fine-tuning).
- :func:`attach`: a ``peft`` LoRA model over a base (targets checked first: a name the model lacks
  is a :class:`LoraError`, one line); only the adapter's parameters require gradients
  (:func:`trainable`); :func:`reference` is peft's disable-adapter context, so the frozen base is
  the KL reference without a second copy of the model.
- :func:`adapter_state` / :func:`load_adapter`: the adapter's tensors under peft's own names (those
  of ``adapter_model.safetensors``), copied in place, strictly (names and shapes).
- :func:`base_digest`: the identity of a base model directory (docs/protocol.md, "Adapter
  versions"); :func:`adapter_spec` / :func:`check_spec`: what a manifest says of an adapter version
  and the one-line refusal of a node whose base differs.
- :func:`weights_loader`: the hook ``TorchBackend`` takes its weight loading from (adapter
  tensors only for a peft model); :func:`adapt_engine`: a node's engine turned into base + adapter.

Nothing here imports torch or peft at module level; peft is imported only when LoRA is used.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from echorl.protocol.messages import AdapterSpec

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama/Qwen-style block: LoRA on attention and MLP together learns
about as well as full fine-tuning at small ranks (the LoRA paper's and peft's advice)."""

BASE_FILE = "base.json"
"""A checkpoint's record of its base model (directory, digest, LoRA settings), for export and resume."""

DIGEST_SCHEME = "echorl-base-v1"
"""Hashed first, so a future change of the digest's definition can never collide with this one."""


class LoraError(ValueError):
    """A LoRA setting, adapter or base the role refuses: one line, exit 2."""


class BaseMismatch(LoraError):
    """The run's adapter versions are for a base model other than this node's."""


@dataclass(frozen=True)
class LoraSettings:
    """The adapter the learner trains (``--lora-*`` flags)."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.rank < 1 or self.alpha <= 0 or not 0 <= self.dropout < 1 or not self.targets:
            raise LoraError("LoRA needs rank >= 1, alpha > 0, 0 <= dropout < 1 and at least one target module")

    @classmethod
    def of(cls, value: LoraSettings | Mapping[str, Any] | None) -> LoraSettings | None:
        """Settings from themselves, their ``asdict`` (a config sent to a worker rank as JSON) or None."""
        if value is None or isinstance(value, LoraSettings):
            return value
        return cls(**dict(value))

    @classmethod
    def from_flags(cls, rank: int, alpha: float, dropout: float, targets: list[str]) -> LoraSettings | None:
        """The ``--lora-*`` flags; ``rank`` 0 is full fine-tuning (None); ``alpha`` 0 means 2 × rank."""
        if rank == 0:
            return None
        return cls(rank, alpha or 2.0 * rank, dropout, tuple(targets) or DEFAULT_TARGETS)


# --- the trainer's model ----------------------------------------------------------------------
def is_adapted(model: Any) -> bool:
    """True iff ``model`` is a peft model (no model can be one while peft was never imported)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(model, PeftModel)


def linear_names(model: Any) -> set[str]:
    """The last name of every ``nn.Linear`` module of ``model`` (what a target module names)."""
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def check_targets(model: Any, targets: tuple[str, ...]) -> None:
    """Every target names a linear layer of ``model``, else one line naming the ones it has."""
    have = linear_names(model)
    missing = [t for t in targets if t not in have]
    if missing:
        names = ", ".join(sorted(have))
        raise LoraError(f"--lora-target: the model has no linear module named {', '.join(missing)} (it has {names})")


def check_model_targets(model_dir: str, targets: tuple[str, ...]) -> None:
    """``check_targets`` on a model directory (``""``: the default model) without loading its
    weights: the architecture is built on the meta device from its config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from echorl.actor.model import default_model

    config = AutoConfig.from_pretrained(Path(model_dir).expanduser() if model_dir else default_model())
    with torch.device("meta"):
        check_targets(AutoModelForCausalLM.from_config(config), targets)


def attach(model: Any, settings: LoraSettings) -> Any:
    """A peft LoRA model over ``model`` (whose weights are frozen from now on)."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, settings.targets)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # typed int, used as a float (alpha / r)
        lora_dropout=settings.dropout,
        target_modules=list(settings.targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def settings_of(model: Any) -> LoraSettings:
    """The LoRA settings a peft model was built with."""
    c = model.peft_config["default"]
    return LoraSettings(int(c.r), float(c.lora_alpha), float(c.lora_dropout), tuple(sorted(c.target_modules)))


def trainable(model: Any) -> list[Any]:
    """The parameters an optimizer steps: the adapter's for a peft model, every one otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


@contextmanager
def reference(model: Any, ref_model: Any | None) -> Iterator[Any]:
    """The KL reference: ``ref_model`` when there is one (full fine-tuning keeps a frozen copy),
    else ``model`` itself with its adapter disabled (peft's context): the frozen base."""
    if ref_model is not None:
        yield ref_model
        return
    with model.disable_adapter():
        yield model


# --- adapter tensors ---------------------------------------------------------------------------
def adapter_state(model: Any) -> dict[str, Any]:
    """Detached CPU copies of the adapter's tensors under peft's names (``adapter_model.safetensors``)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, save_embedding_layers=False)  # never the base's embeddings
    return {k: v.detach().to("cpu").clone() for k, v in state.items()}


def load_adapter(model: Any, state: Mapping[str, Any]) -> None:
    """Copy adapter tensors into ``model``'s adapter in place; the names and shapes must be
    exactly the adapter's (an adapter of another rank, targets or architecture is refused)."""
    import torch
    from peft import get_peft_model_state_dict

    live = get_peft_model_state_dict(model, save_embedding_layers=False)  # views of the adapter's parameters
    missing = sorted(set(live) - set(state))
    unexpected = sorted(set(state) - set(live))
    if missing or unexpected:
        raise LoraError(f"adapter does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, value in state.items():
        src = torch.as_tensor(value)
        if src.shape != live[name].shape:
            raise LoraError(f"adapter tensor {name}: shape {tuple(src.shape)} != {tuple(live[name].shape)}")
    with torch.no_grad():
        for name, value in state.items():
            target = live[name]
            target.copy_(torch.as_tensor(value).to(dtype=target.dtype, device=target.device))


def weights_loader(model: Any) -> Callable[[Mapping[str, Any]], None] | None:
    """How ``TorchBackend`` loads a version into ``model``: adapter tensors for a peft model,
    None (the backend's full in-place copy) otherwise."""
    if not is_adapted(model):
        return None
    return lambda state: load_adapter(model, state)


# --- the base model's identity -----------------------------------------------------------------
def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory (one, or the shards of a large model)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise LoraError(f"{model_dir} has no .safetensors weights (import a GGUF with `echorl import-gguf`)")
    return files


_digests: dict[tuple[tuple[str, int, int], ...], bytes] = {}  # by (file, size, mtime): a base is hashed once


def base_digest(model_dir: str | Path) -> bytes:
    """:func:`hash_base` of ``model_dir``, remembered while its weight files are unchanged."""
    files = weight_files(Path(model_dir))
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _digests:
        _digests[key] = hash_base(files)
    return _digests[key]


def hash_base(files: list[Path]) -> bytes:
    """SHA-256 identity of a base model directory's weights (docs/protocol.md, "Adapter versions"):
    over ``DIGEST_SCHEME``, then every tensor of every ``*.safetensors`` file sorted by name, each
    as its name, dtype, shape (JSON) and byte length, then its raw bytes as stored. File names,
    sharding, header order and metadata do not matter; a change of any weight, dtype or shape does."""
    from echorl.protocol.snapshot import parse_header

    h = hashlib.sha256(DIGEST_SCHEME.encode())
    views: dict[str, tuple[Any, int, int, str, tuple[int, ...]]] = {}
    maps = []
    try:
        for path in files:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            maps.append(m)
            (header_len,) = struct.unpack("<Q", m[:8])
            _, tensors = parse_header(m[: 8 + header_len], len(m))
            for t in tensors:
                if t.name in views:
                    raise LoraError(f"{path.parent}: tensor {t.name} is in two weight files")
                views[t.name] = (m, t.start, t.end, t.dtype, t.shape)
        for name in sorted(views):
            m, start, end, dtype, shape = views[name]
            h.update(json.dumps([name, dtype, list(shape), end - start]).encode() + b"\n")
            h.update(memoryview(m)[start:end])
    finally:
        views.clear()
        for m in maps:
            m.close()
    return h.digest()


def model_dir_of(model: Any) -> Path | None:
    """The directory ``model`` (or a peft model's base) was loaded from, if it is one."""
    base = model.get_base_model() if is_adapted(model) else model
    path = getattr(base, "name_or_path", "") or ""
    return Path(path) if path and (Path(path) / "config.json").is_file() else None


def adapter_spec(model: Any, digest: bytes) -> AdapterSpec:
    """What every manifest of this run's adapter versions says: base digest, rank, alpha, targets."""
    from echorl.protocol.messages import AdapterSpec

    s = settings_of(model)
    return AdapterSpec(base_digest=digest, rank=s.rank, alpha=s.alpha, target_modules=list(s.targets))


def run_adapter(model: Any) -> AdapterSpec | None:
    """The learner's ``AdapterSpec`` for the model it trains (its base hashed from the directory it
    was loaded from); None for full fine-tuning."""
    if not is_adapted(model):
        return None
    model_dir = model_dir_of(model)
    if model_dir is None:
        raise LoraError("a LoRA run's base must be a model directory (--model DIR): nodes check it by digest")
    return adapter_spec(model, base_digest(model_dir))


def spec_settings(spec: AdapterSpec) -> LoraSettings:
    """The settings an engine attaches for ``spec`` (no dropout: engines only sample)."""
    return LoraSettings(spec.rank, spec.alpha, 0.0, tuple(spec.target_modules))


def check_spec(spec: AdapterSpec, digest: bytes, model_dir: str | Path) -> None:
    """A node whose base is not the learner's is refused in one line."""
    if spec.base_digest != digest:
        raise LoraError(
            f"this run trains a LoRA adapter over base model {spec.base_digest.hex()[:16]}, but --model "
            f"{model_dir} is {digest.hex()[:16]}: start the node with the learner's base model"
        )


def adapt_engine(backend: Any, settings: LoraSettings) -> Any:
    """An engine as base + adapter: one that knows how (``with_adapter``: the vLLM engine,
    through vLLM's LoRA support) does it itself; a torch engine through peft."""
    if hasattr(backend, "with_adapter"):
        return backend.with_adapter(settings)
    return adapt_backend(backend, settings)


def adapt_backend(backend: Any, settings: LoraSettings) -> Any:
    """A torch engine as base + adapter: a new ``TorchBackend`` over a peft model of the same
    weights (attached once; its adapter starts at zero, i.e. the base itself)."""
    from echorl.actor.backend import TorchBackend

    return TorchBackend(attach(backend.model, settings), backend.tokenizer, version=backend.version)


# --- checkpoints --------------------------------------------------------------------------------
def check_resume(model: Any, record: Mapping[str, Any]) -> None:
    """A checkpoint resumes only onto its own kind of training (adapter or full) and, for an
    adapter, onto the base it was trained on (``record``: its ``BASE_FILE``; empty: not known)."""
    if not record:
        return
    if (record.get("lora") is not None) != is_adapted(model):
        kind = "a LoRA adapter" if record.get("lora") else "full weights"
        raise LoraError(f"the checkpoint holds {kind}: resume with the same --lora-rank it was trained with")
    model_dir = model_dir_of(model)
    want = record.get("base_digest")
    if is_adapted(model) and want and model_dir is not None and base_digest(model_dir).hex() != want:
        raise LoraError(f"the checkpoint's adapter is for base model {want[:16]}, not --model {model_dir}")


def base_record(model: Any) -> dict[str, Any]:
    """What a checkpoint keeps of its base (``BASE_FILE``): directory, digest (of an adapter's
    base only: full weights replace theirs) and LoRA settings (None for full fine-tuning)."""
    model_dir = model_dir_of(model)
    adapted = is_adapted(model)
    return {
        "base_model": str(model_dir.resolve()) if model_dir is not None else None,
        "base_digest": base_digest(model_dir).hex() if model_dir is not None and adapted else None,
        "lora": asdict(settings_of(model)) if adapted else None,
    }
