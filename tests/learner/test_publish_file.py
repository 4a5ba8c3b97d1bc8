"""The learner publishes a version from a file: the state dict is written to a staging file one
tensor at a time (byte-identical to the safetensors library's own ``save``), broadcast from it
memory-mapped, and kept as files; no copy of the version's bytes lives in the process."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
import trio
from safetensors.torch import save

from echorl.broadcast.broadcaster import Broadcaster
from echorl.learner.publish import Publisher, write_state_dict_file
from echorl.net.host import open_host
from echorl.protocol.identity import Identity

pytestmark = pytest.mark.timeout(120)


class _Service:
    def __init__(self) -> None:
        self.published: list[tuple[int, int]] = []

    def note_published(self, version: int, weights_bytes: int) -> None:
        self.published.append((version, weights_bytes))

    def broadcast_nodes(self) -> list:
        return []


def _state(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 512, generator=g)
    w[0, : 8 * step] += 1.0  # a few changed weights: the next version is a small delta
    return {
        "w": w,
        "head": w,
        "norm": torch.ones(512, dtype=torch.bfloat16) * (1 + step),
        "step": torch.tensor(step),
        "t": torch.randn(16, 8, generator=g).t(),
    }  # tied, bf16, 0-d, strided


def _reference(sd: dict[str, torch.Tensor]) -> bytes:
    return save({k: v.contiguous().clone() for k, v in sd.items()})


def test_the_streamed_file_is_what_the_safetensors_library_writes(tmp_path):
    path = tmp_path / "staged"
    assert write_state_dict_file(_state(1), path) == len(_reference(_state(1)))
    assert path.read_bytes() == _reference(_state(1))
    write_state_dict_file({"x": torch.zeros(3)}, path)  # overwritten in place, shorter
    assert path.read_bytes() == save({"x": torch.zeros(3)})
    with pytest.raises(ValueError, match="dtype"):
        write_state_dict_file({"c": torch.zeros(2, dtype=torch.complex64)}, path)


def test_a_version_is_published_from_its_file_without_a_copy_in_memory(tmp_path):
    async def main():
        li = Identity.generate()
        async with open_host(li) as lh:
            bc = Broadcaster(lh, li, "r", full_every=4, direct=False, store_dir=tmp_path / "store")
            bc.install()
            service = _Service()
            pub = Publisher(bc, service)  # type: ignore[arg-type]
            size = len(_reference(_state(0)))
            for version in (0, 1):
                sd = _state(version)
                tracemalloc.start()
                record = await pub.publish(version, sd)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                assert record.kind == ("full" if version == 0 else "delta")
                assert peak < 0.25 * size, (peak, size)  # serializing to bytes alone would be 1x
                held = await trio.to_thread.run_sync(bc.version_bytes, version)
                assert held == _reference(sd)
            assert service.published == [(0, size), (1, size)]

    trio.run(main)
