"""Mixed precision of the learner: fp32 master weights and optimizer state, half-precision compute
where the device has it, half-precision copies published to the nodes.

A policy kept in bfloat16 loses its updates: bf16 has 8 significant bits, so ``w + lr * u`` rounds
back to ``w`` whenever ``|lr * u| < |w| / 256``; at lr 1e-6 nearly every step of every weight
vanishes (measured in ``tests/rl/test_precision.py``: the update's cosine to the fp32 update was
0.085 with bf16 weights and AdamW state). So the trainer keeps its parameters, gradients and AdamW
moments in float32 whatever ``--dtype`` says, and ``--dtype bfloat16`` (the default on CUDA) means:

* the forward and backward passes run under ``torch.autocast`` in bfloat16 (matmuls in bf16, the
  log-softmax and the loss in fp32), where the device supports it (:func:`compute_dtype`);
* every published version is a bfloat16 copy of the master weights (:func:`published_copy`): half
  the bytes on the wire, and what the nodes' bf16 engines load anyway. Checkpoints keep fp32.

``float16`` asks for the same, with float16 copies; its compute also runs in bfloat16 (float16
gradients need loss scaling, which this trainer does not do), or in fp32 where bf16 is missing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

HALF_DTYPES = ("bfloat16", "float16")
"""``--dtype`` values that mean mixed precision: fp32 master weights, half compute and copies."""


def master_dtype(dtype: str) -> str:
    """The dtype the trainer keeps its weights and optimizer state in for ``--dtype dtype``."""
    return "float32" if dtype in HALF_DTYPES else dtype


def compute_dtype(device: str, dtype: str) -> torch.dtype | None:
    """The autocast dtype of the trainer's passes (None: no autocast, compute in the master dtype):
    bfloat16 for a half ``dtype`` on the CPU and on a CUDA device with bf16 (Ampere and later)."""
    import torch

    if dtype not in HALF_DTYPES:
        return None
    if device.startswith("cuda") and not torch.cuda.is_bf16_supported():
        return None
    return torch.bfloat16


@contextlib.contextmanager
def autocast(device: str, dtype: str) -> Iterator[None]:
    """The trainer's forward/backward context for ``--dtype dtype`` on ``device``."""
    import torch

    half = compute_dtype(device, dtype)
    if half is None:
        yield
        return
    with torch.autocast(device_type=device.partition(":")[0], dtype=half):
        yield


def published_copy(state: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """``state`` with every floating-point tensor cast to ``dtype`` (the copies the nodes get);
    other tensors, and every tensor when ``dtype`` is the master dtype, as they are."""
    import torch

    if dtype not in HALF_DTYPES:
        return state
    half = getattr(torch, dtype)
    return {k: v.to(half) if v.is_floating_point() else v for k, v in state.items()}
