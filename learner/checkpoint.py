"""Checkpoint and resume of the learner: model, optimizer, version, RNG states, data cursor and
the prompts still pending (re-queued, leased or buffered), so a resumed run continues with the
same version numbers and neither repeats nor skips prompts.

Layout under ``root``: ``v00000042/`` (``model.safetensors``, ``optimizer.pt``, ``state.json``)
and ``LATEST`` (name of the newest complete checkpoint). Every file is written to a temporary
name, fsync'ed and renamed (``os.replace``); a checkpoint directory is assembled under a
temporary name and renamed into place before ``LATEST`` is switched, so a crash at any moment
leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echorl.atomic import atomic_write_bytes, fsync_dir
from echorl.tasks.base import Prompt

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


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch RNG states as JSON-friendly values."""
    import numpy as np
    import torch

    py = random.getstate()
    npst = np.random.get_state()
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
    trainer: Any,
    cursor: int,
    pending: list[Prompt] | None = None,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write a checkpoint of ``trainer`` (a :class:`GRPOTrainer`) at its current version."""
    import io

    import torch
    from safetensors.torch import save

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"v{trainer.version:08d}"
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        atomic_write_bytes(tmp / "model.safetensors", save(trainer.state_dict()))
        buf = io.BytesIO()
        torch.save(trainer.optimizer.state_dict(), buf)
        atomic_write_bytes(tmp / "optimizer.pt", buf.getvalue())
        state = {
            "version": trainer.version, "cursor": int(cursor),
            "pending": [p.to_dict() for p in (pending or [])],
            "rng": rng_state(), "extra": extra or {},
        }
        atomic_write_bytes(tmp / "state.json", json.dumps(state).encode())
        final = root / name
        if final.exists():
            shutil.rmtree(final)
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


def has_checkpoint(root: str | Path) -> bool:
    return (Path(root) / LATEST).is_file()


def load_checkpoint(root: str | Path) -> Checkpoint:
    """Read the newest complete checkpoint under ``root``."""
    import torch
    from safetensors.torch import load_file

    root = Path(root)
    if not has_checkpoint(root):
        raise FileNotFoundError(f"no checkpoint in {root} (missing {LATEST})")
    path = root / (root / LATEST).read_text().strip()
    state = json.loads((path / "state.json").read_text())
    return Checkpoint(
        path=path,
        version=int(state["version"]),
        cursor=int(state["cursor"]),
        pending=[Prompt.from_dict(p) for p in state["pending"]],
        model_state=load_file(path / "model.safetensors"),
        optimizer_state=torch.load(path / "optimizer.pt", weights_only=True),
        rng=state["rng"],
        extra=state.get("extra", {}),
    )


def restore_trainer(trainer: Any, ckpt: Checkpoint, rng: bool = True) -> None:
    """Load model, optimizer and version (and, by default, the RNG states) into ``trainer``
    (anything with ``GRPOTrainer.load_state``: a data-parallel trainer passes them to every rank)."""
    trainer.load_state(ckpt.model_state, ckpt.optimizer_state, ckpt.version)
    if rng:
        restore_rng(ckpt.rng)
