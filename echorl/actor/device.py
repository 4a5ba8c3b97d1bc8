"""Honest device choice: ``auto`` picks CUDA only where torch sees it, an explicit CUDA request on a
machine without one is an error (never a silent fallback to the CPU), and ``dtype=auto`` means
bfloat16 on CUDA, float32 on the CPU. Used by the learner, the node and train-local before
anything heavy loads."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from echorl.common.config import ModelFields


class DeviceError(ValueError):
    """The asked-for device is not here."""


def resolve_device(device: str, dtype: str = "auto") -> tuple[str, str]:
    """``(device, dtype)`` as torch names them (``"cuda:0"``, ``"bfloat16"``) for the asked
    ``device`` (auto, cpu, cuda, cuda:N) and ``dtype`` (auto or a torch dtype name)."""
    import torch

    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError(
                f"--device {device}: CUDA is not available here (torch {torch.__version__}); use --device cpu or auto"
            )
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
        device = f"cuda:{index}"
    elif device != "cpu":
        raise DeviceError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise DeviceError(f"--dtype {dtype}: not a torch dtype")
    return device, dtype


def describe_device(device: str) -> str:
    """What the logs say: the CUDA device's name, or ``cpu``."""
    import torch

    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return device


FLOAT32_MATMUL_PRECISION = "highest"
"""float32 matmuls at full precision, never TF32: the sampling replay's strict row (a float32
node checked by a float32 learner, ``learner/tolerances.py``) holds only then. On an H200 a TF32
node's gaps reached 0.021 and 9 of 157 honest SmolLM2 submissions were refused (docs/threat-model.md);
the cost is float32 matmul speed on CUDA, which a bf16 node (the CUDA default) does not pay."""


def pin_device(cfg: ModelFields) -> str:
    """Replace ``cfg.device``/``cfg.dtype`` ``auto`` by the device and dtype really used (CUDA
    asked for where there is none: :class:`DeviceError`, a ``ValueError``) and fix the process's
    float32 matmul precision (:data:`FLOAT32_MATMUL_PRECISION`); returns how the logs should name
    it. Imports torch."""
    import torch

    cfg.device, cfg.dtype = resolve_device(cfg.device, cfg.dtype)
    torch.set_float32_matmul_precision(FLOAT32_MATMUL_PRECISION)
    return f"{describe_device(cfg.device)}, {cfg.dtype}"
