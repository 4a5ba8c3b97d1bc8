"""Checkpoint and resume of the learner: model, optimizer, version, RNG states, data cursor and
the prompts still pending (re-queued, leased or buffered), so a resumed run continues with the
same version numbers and neither repeats nor skips prompts.

Layout under ``root``: ``v00000042/`` (``model.safetensors``, ``optimizer.pt``, ``state.json``,
``base.json``: the base model's directory and digest, and the LoRA settings when the model
trained is an adapter, whose tensors alone are then ``model.safetensors``; ``actor/lora.py``)
and ``LATEST`` (name of the newest complete checkpoint). Every file is written to a temporary
name, fsync'ed and renamed (``os.replace``); a checkpoint directory is assembled under a
temporary name and renamed into place before ``LATEST`` is switched, so a crash at any moment
leaves the previous checkpoint intact.

A re-save of a version already on disk goes to a new directory (``v00000042-1``, ...), so the
complete checkpoint ``LATEST`` names is never deleted before ``LATEST`` names its successor;
:func:`load_checkpoint` falls back to the newest complete directory if ``LATEST`` names nothing
usable. Temporary files and directories a crashed save left behind are removed at the next save
(:func:`clean_temp`). Weights that are not finite are never saved (``ValueError``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from echorl.actor import lora
from echorl.common.atomic import atomic_write_bytes, fsync_dir
from echorl.tasks.base import Prompt

if TYPE_CHECKING:
    from echorl.rl.seams import Trainer

LATEST = "LATEST"


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns."""

    path: Path
    version: int
    cursor: int
    pending: list[Prompt]
    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    base: dict[str, Any] = field(default_factory=dict)  # base.json (empty for a checkpoint without one)


def check_state_keys(owner: str, state: Any, allowed: set[str]) -> dict[str, Any]:
    """``state`` as a dict whose keys are all in ``allowed``; a clear error otherwise (a
    checkpoint written by another version of the code, or a hand-edited one)."""
    if not isinstance(state, dict):
        raise ValueError(f"{owner} state must be a dict, not {type(state).__name__}")
    unexpected = sorted(set(state) - allowed)
    if unexpected:
        raise ValueError(f"unexpected keys in {owner} state: {unexpected} (known: {sorted(allowed)})")
    return state


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as JSON-friendly values."""
    import numpy as np
    import torch

    py = random.getstate()
    npst = cast(tuple[Any, ...], np.random.get_state())  # the legacy tuple
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
        "torch": torch.get_rng_state().tolist(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def save_checkpoint(
    root: str | Path,
    trainer: Trainer,
    cursor: int,
    pending: list[Prompt] | None = None,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write a checkpoint of ``trainer`` (a :class:`GRPOTrainer`) at its current version."""
    import io

    import torch
    from safetensors.torch import save

    from echorl.rl.grpo import state_dict_finite

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    clean_temp(root)
    weights = trainer.state_dict()
    if not state_dict_finite(weights):
        raise ValueError(f"v{trainer.version}: non-finite weights are never checkpointed")
    name = _free_name(root, f"v{trainer.version:08d}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        atomic_write_bytes(tmp / "model.safetensors", save(weights))
        atomic_write_bytes(tmp / lora.BASE_FILE, json.dumps(lora.base_record(trainer.model)).encode())
        buf = io.BytesIO()
        torch.save(trainer.optimizer.state_dict(), buf)
        atomic_write_bytes(tmp / "optimizer.pt", buf.getvalue())
        state = {
            "version": trainer.version,
            "cursor": int(cursor),
            "pending": [p.to_dict() for p in (pending or [])],
            "rng": rng_state(),
            "extra": extra or {},
        }
        atomic_write_bytes(tmp / "state.json", json.dumps(state).encode())
        final = root / name
        os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    atomic_write_bytes(root / LATEST, name.encode())
    olds = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("v") and p.name != name)
    for old in olds[: max(0, len(olds) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _free_name(root: Path, base: str) -> str:
    """``base``, or ``base-N`` when a checkpoint of that version exists (names sort in save order)."""
    if not (root / base).exists():
        return base
    n = 1
    while (root / f"{base}-{n:04d}").exists():
        n += 1
    return f"{base}-{n:04d}"


def clean_temp(root: Path) -> int:
    """Remove what an interrupted save left (``.v*`` temp dirs, ``.LATEST.*`` / ``.*.tmp`` files);
    returns how many entries went. Only call while no save runs (saves are serial)."""
    gone = 0
    for p in root.iterdir():
        if not p.name.startswith("."):
            continue
        if p.is_dir() and p.name.startswith(".v"):
            shutil.rmtree(p, ignore_errors=True)
            gone += 1
        elif p.is_file() and p.name.startswith(f".{LATEST}."):
            p.unlink(missing_ok=True)
            gone += 1
    return gone


def is_complete(path: Path) -> bool:
    """A checkpoint directory with every file of a checkpoint in it."""
    return all((path / f).is_file() for f in ("model.safetensors", "optimizer.pt", "state.json"))


def _newest_complete(root: Path) -> Path | None:
    """The directory to load: the one ``LATEST`` names if complete, else the newest complete one."""
    latest = root / LATEST
    if latest.is_file():
        named = root / latest.read_text().strip()
        if named.name.startswith("v") and is_complete(named):
            return named
    dirs = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith("v") and is_complete(p)),
        key=lambda p: p.name,
        reverse=True,
    )
    return dirs[0] if dirs else None


def has_checkpoint(root: str | Path) -> bool:
    root = Path(root)
    return root.is_dir() and _newest_complete(root) is not None


def finished_run(root: str | Path, steps: int) -> str | None:
    """What ``--resume`` says instead of training when the newest checkpoint under ``root`` is
    already at ``steps`` (training would do nothing and only write a copy of it); None otherwise,
    or when the checkpoint cannot be read (the resume itself then says why)."""
    root = Path(root)
    path = _newest_complete(root) if steps > 0 and root.is_dir() else None
    try:
        version = int(json.loads((path / "state.json").read_text())["version"]) if path else -1
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if version < steps:
        return None
    return (
        f"the run in {root} is finished (step {version} of --steps {steps}); nothing to do: raise --steps "
        f"(e.g. --steps {version + steps}) to continue it"
    )


def load_checkpoint(root: str | Path) -> Checkpoint:
    """Read the newest complete checkpoint under ``root``."""
    root = Path(root)
    path = _newest_complete(root) if root.is_dir() else None
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint in {root}")
    return read_checkpoint(path)


def read_checkpoint(path: Path) -> Checkpoint:
    """Read one complete checkpoint directory (``v…``)."""
    import torch
    from safetensors.torch import load_file

    state = json.loads((path / "state.json").read_text())
    base = path / lora.BASE_FILE
    return Checkpoint(
        path=path,
        version=int(state["version"]),
        cursor=int(state["cursor"]),
        pending=[Prompt.from_dict(p) for p in state["pending"]],
        model_state=load_file(path / "model.safetensors"),
        optimizer_state=torch.load(path / "optimizer.pt", weights_only=True),
        rng=state["rng"],
        extra=state.get("extra", {}),
        base=json.loads(base.read_text()) if base.is_file() else {},
    )


def restore_trainer(trainer: Trainer, ckpt: Checkpoint, rng: bool = True) -> None:
    """Load model, optimizer and version (and, by default, the RNG states) into ``trainer``
    (anything with ``GRPOTrainer.load_state``: a data-parallel trainer passes them to every rank)."""
    lora.check_resume(trainer.model, ckpt.base)
    trainer.load_state(ckpt.model_state, ckpt.optimizer_state, ckpt.version)
    if rng:
        restore_rng(ckpt.rng)
