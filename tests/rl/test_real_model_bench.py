"""bench/real_model.py's learning rate: the settings file's (tuned for the adapter) with LoRA,
``FULL_LR`` for full fine-tuning (the adapter's rate collapsed a full model: held-out reward
0.17 -> 0.0 in 6 steps), ``--lr`` over both; the run's settings file carries it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_path = list(sys.path)
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import real_model  # noqa: E402

sys.path[:] = _path


def test_full_fine_tuning_gets_its_own_rate_and_lr_wins() -> None:
    def rate(rank: int, lr: float = 0.0) -> float:
        return real_model.learning_rate(argparse.Namespace(lora_rank=rank, lr=lr))

    assert rate(16) == 1e-3  # examples/smollm2-arithmetic.toml
    assert rate(0) == real_model.FULL_LR < rate(16) / 10
    assert rate(0, 3e-6) == rate(16, 3e-6) == 3e-6
