"""bench/rollout_throughput.py --batching-rounds: a lease's sequences sampled in one batch against
the same number drawn one at a time, on the shipped tiny model (the SmolLM2 figure is in
docs/lora-notes.md)."""

from __future__ import annotations

import sys
from pathlib import Path

_path = list(sys.path)
sys.path.append(str(Path(__file__).resolve().parents[2] / "bench"))
import rollout_throughput  # noqa: E402

sys.path[:] = _path


def test_a_batched_lease_samples_as_many_sequences_faster_than_one_at_a_time() -> None:
    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import default_model
    from echorl.tasks import load_task

    backend = TorchBackend.from_pretrained(default_model())
    out = rollout_throughput.batching(backend, load_task("addition"), lease_prompts=2, group_size=8, rounds=2)
    assert out["tokens_batched"] > 0 and out["tokens_one_at_a_time"] > 0
    assert out["batching_speedup"] > 1.5, out  # 16 rows in one call vs 16 calls (8x on an idle core)
