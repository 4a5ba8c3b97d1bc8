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


def pin_device(cfg: ModelFields) -> str:
    """Replace ``cfg.device``/``cfg.dtype`` ``auto`` by the device and dtype really used (CUDA
    asked for where there is none: :class:`DeviceError`, a ``ValueError``); returns how the logs
    should name it. Imports torch."""
    cfg.device, cfg.dtype = resolve_device(cfg.device, cfg.dtype)
    return f"{describe_device(cfg.device)}, {cfg.dtype}"
