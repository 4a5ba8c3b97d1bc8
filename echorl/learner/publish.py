"""The learner's publication task: broadcasts the newest trained version to the joined nodes
while training goes on (architecture §6–7); the broadcaster's store then holds it for catch-up, the
nodes' direct fetch and spot checks.

The training loop only *offers* a version (a detached copy of the weights, every κ steps); this
task, in the learner's nursery, publishes the newest offered version as soon as the previous
broadcast is done. Versions offered meanwhile are skipped, so the next delta's base is the last
*published* version (the ``Broadcaster`` deltas against its own previous ``publish``). Training
never waits for a broadcast; nodes that fall behind are paced by the lease policy and catch up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import trio

from echorl.broadcast.files import mapped
from echorl.protocol import snapshot
from echorl.rl.checkpoint import check_state_keys

if TYPE_CHECKING:
    from echorl.broadcast.broadcaster import Broadcaster
    from echorl.learner.service import LearnerService

log = logging.getLogger(__name__)


@dataclass
class BroadcastRecord:
    """One completed publication, as the metrics report it."""

    version: int
    kind: str  # "full" | "delta"
    seconds: float  # announce → last node verified (BroadcastReport.seconds)
    build_seconds: float  # delta encoding + hashing + signing
    serialize_seconds: float  # state dict → safetensors
    bytes: int  # payload bytes sent (delta or full)
    result_bytes: int  # the version's safetensors size
    nodes: int
    completed: int
    missing: int

    @property
    def t_bcast(self) -> float:
        """Dissemination latency of the capacity model: offer → every node verified."""
        return self.serialize_seconds + self.build_seconds + self.seconds

    def metrics(self) -> dict[str, Any]:
        return {
            "broadcast_seconds": self.seconds,
            "broadcast_version": self.version,
            "broadcast_kind": self.kind,
            "broadcast_bytes": self.bytes,
            "broadcast_result_bytes": self.result_bytes,
            "broadcast_build_seconds": self.build_seconds,
            "broadcast_nodes": self.nodes,
            "broadcast_completed": self.completed,
            "broadcast_missing": self.missing,
        }


#: the file each version is serialized into before it is published (overwritten by the next one,
#: in the broadcaster's store directory: not a version file, so never collected)
STAGING_NAME = "publish-staging.safetensors"
_TORCH_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def write_state_dict_file(state_dict: dict[str, Any], path: Path) -> int:
    """Write ``state_dict`` to ``path`` as a safetensors file, one tensor at a time (memory: the
    largest tensor's CPU copy, none for a CPU tensor already contiguous); an existing file is
    overwritten in place, so its cached pages are reused. Returns the file's size."""
    import torch

    tensors = {k: v.detach() for k, v in state_dict.items()}
    try:
        entries = [(k, _TORCH_DTYPES[str(t.dtype).removeprefix("torch.")], tuple(t.shape)) for k, t in tensors.items()]
    except KeyError as exc:
        raise ValueError(f"cannot publish a tensor of dtype {exc}") from None
    head, layout = snapshot.safetensors_header(entries)
    size = len(head) + (layout[-1][2] if layout else 0)
    with open(path, "r+b" if path.exists() else "wb") as f:
        f.truncate(size)
        f.write(head)
        for name, _, _ in layout:
            flat = tensors[name].to("cpu").contiguous().reshape(-1)
            f.write(memoryview(flat.view(torch.uint8).numpy()))
    return size


class Publisher:
    def __init__(
        self,
        broadcaster: Broadcaster,
        service: LearnerService,
        *,
        timeout_s: float = 120.0,
        on_record: Callable[[BroadcastRecord], None] | None = None,
    ) -> None:
        self.bc = broadcaster
        self.service = service
        self.timeout_s = timeout_s
        self.on_record = on_record
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._wake = trio.Event()
        self._idle = trio.Event()
        self._idle.set()
        self.offered = -1
        self.last: BroadcastRecord | None = None  # newest completed broadcast
        self.records: list[BroadcastRecord] = []
        self.skipped = 0

    def metrics(self) -> dict[str, Any]:
        """The publications' part of a metrics row: the newest completed broadcast, versions
        skipped, and the broadcaster's serving refusals."""
        last = self.last
        bcast = (
            last.metrics()
            if last is not None
            else {"broadcast_seconds": None, "broadcast_version": None, "broadcast_kind": None}
        )
        out: dict[str, Any] = {**self.bc.metrics(), **bcast, "broadcasts_skipped": self.skipped}
        if last is not None:
            out["broadcast_seconds_by_kind"] = {last.kind: last.seconds}
        return out

    def state_dict(self) -> dict[str, Any]:
        """Counters that continue across a resume (the first publication after it is a full
        snapshot of the resumed version, so nothing of the broadcast chain is kept)."""
        return {"skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = check_state_keys("publisher", state, {"skipped"})
        self.skipped = int(state.get("skipped", 0))

    def offer(self, version: int, state_dict: dict[str, Any]) -> None:
        """Hand the newest trained version over (never blocks); replaces an unpublished one."""
        if self._pending is not None:
            self.skipped += 1
        self._pending = (version, state_dict)
        self.offered = version
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._wake.set()

    async def run(self) -> None:
        """Forever: publish the newest offered version, one broadcast at a time (a version
        offered before this starts is published at once: ``offer`` sets the wake-up)."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            while self._pending is not None:
                version, state = self._pending
                self._pending = None
                try:
                    await self.publish(version, state)
                except Exception:
                    log.exception("publishing v%d failed; the next version will be published", version)
            self._idle.set()

    async def drain(self, timeout: float) -> bool:
        """Wait until every offered version is published (or ``timeout``); True if done."""
        with trio.move_on_after(timeout):
            await self._idle.wait()
        return self._idle.is_set()

    async def publish(self, version: int, state_dict: dict[str, Any]) -> BroadcastRecord:
        """Serialise to the staging file, broadcast it (memory-mapped: the version's bytes are
        never a copy in this process) to the joined nodes (the broadcaster's store keeps it),
        record."""
        t0 = time.perf_counter()
        staged = self.bc.server.store.dir / STAGING_NAME
        size = await trio.to_thread.run_sync(write_state_dict_file, state_dict, staged)
        serialize_s = time.perf_counter() - t0
        self.service.note_published(version, weights_bytes=size)
        with mapped(staged) as data:
            payload = cast(bytes, data)  # the broadcaster reads it as a buffer: no copy of the version
            report = await self.bc.publish(version, payload, self.service.broadcast_nodes(), timeout=self.timeout_s)
        rec = BroadcastRecord(
            version,
            report.kind,
            report.seconds,
            report.build_seconds,
            serialize_s,
            report.bytes,
            report.result_bytes,
            report.nodes,
            len(report.completed),
            len(report.missing),
        )
        self.last = rec
        self.records.append(rec)
        del self.records[:-4096]
        log.debug(
            "broadcast v%d %s: %d/%d nodes in %.3f s (%d B of %d; build %.3f s)",
            version,
            rec.kind,
            rec.completed,
            rec.nodes,
            rec.seconds,
            rec.bytes,
            rec.result_bytes,
            rec.build_seconds,
        )
        if self.on_record is not None:
            self.on_record(rec)
        return rec
