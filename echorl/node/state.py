"""A node's newest verified weight snapshot on disk, so a restart does not re-download it.

Layout of a state directory (one per node key and run; ``default_state_dir``)::

    v<version>.safetensors   the version's safetensors file (the result, never a delta payload)
    v<version>.manifest      the learner's signed ``Manifest`` of that version (``wire.encode``)

Only the newest pair is kept. Every file is written atomically (temporary file, fsync,
``os.replace``, fsync of the directory); the weights go first and the manifest last, so a
manifest on disk always has its weights beside it, and a crash between the two leaves at most
one stale pair that the next write or load removes.

The weights file *is* the relay's store file: ``offer`` hard-links it into the state directory
(``.v<version>.pending.tmp``; a copy only where the file system refuses links), so a version is
on disk once however many names it has, and the relay may drop its own name meanwhile.

Nothing read back is trusted: the manifest is decoded strictly, must be signed by the pinned
learner for this run (``verify_manifest``), and the weights must be exactly the result it
describes (``verify_result_file``: file digest and every tensor's digest, streamed over the
file). A pair that fails is deleted, with a log line saying why. The same checks run before a
pair is written.

``SnapshotKeeper`` does the writing for the node daemon from a trio task: every disk operation
runs in a worker thread, never on the event loop. Write policy: only the newest version offered
is written, at most once per ``max(MIN_INTERVAL_S, DUTY_FACTOR × last write time)`` (so a large
model spends at most ~10% of the time writing), and ``flush`` writes the newest one pending at
once (the daemon calls it on SIGTERM/SIGINT before exiting).
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import trio

from echorl.broadcast.files import verify_result_file
from echorl.broadcast.store import link_or_copy
from echorl.common.atomic import atomic_write_bytes, fsync_dir
from echorl.protocol import limits, snapshot, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import Manifest

log = logging.getLogger("echorl.node.state")

MIN_INTERVAL_S = 5.0  # at most one snapshot write per this many seconds (plus the one at exit)
DUTY_FACTOR = 10.0  # ... and at most one per DUTY_FACTOR × the last write's duration
_NAME = re.compile(r"^v(\d{1,16})\.(safetensors|manifest)$")


@dataclass(frozen=True)
class Snapshot:
    """A verified version: its signed manifest and its safetensors file."""

    manifest: Manifest
    path: Path

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def data(self) -> bytes:
        """The whole file (tests and small models; load large ones through ``path``)."""
        return self.path.read_bytes()


def default_state_dir(key_path: str | os.PathLike[str], run_id: str) -> Path:
    """``<key dir>/state-<key name>-<run id>``: next to the key, one per key (several nodes may
    keep their keys in one folder) and per run."""
    key = Path(key_path).expanduser()
    safe_run = re.sub(r"[^A-Za-z0-9._-]", "_", run_id) or "run"
    safe_key = re.sub(r"[^A-Za-z0-9._-]", "_", key.stem) or "node"
    return key.parent / f"state-{safe_key}-{safe_run}"


def lock_state_dir(state_dir: Path) -> IO[bytes] | None:
    """Take the state directory for this process (an exclusive ``flock`` on ``state_dir/lock``,
    released when the process ends, however it ends); None if another live process holds it.
    Two processes with one key share one state directory, and the second would otherwise clean
    the first one's store out from under it before the learner could refuse it."""
    import fcntl

    state_dir.mkdir(parents=True, exist_ok=True)
    f = open(state_dir / "lock", "ab")  # noqa: SIM115 - held open for the process's lifetime
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def verify_snapshot(manifest: Manifest, path: Path, learner_peer_id: str, run_id: str) -> None:
    """Signed by the pinned learner for this run, and ``path`` is exactly the version's file.
    Raises ``ProtocolError``."""
    snapshot.verify_manifest(manifest, learner_peer_id, run_id)
    verify_result_file(manifest, path)


# --- files -----------------------------------------------------------------------------------


def _versions_on_disk(state_dir: Path) -> dict[int, set[str]]:
    """version -> {"safetensors", "manifest"} for the snapshot files present."""
    out: dict[int, set[str]] = {}
    if not state_dir.is_dir():
        return out
    for entry in state_dir.iterdir():
        m = _NAME.match(entry.name)
        if m:
            out.setdefault(int(m.group(1)), set()).add(m.group(2))
    return out


def _paths(state_dir: Path, version: int) -> tuple[Path, Path]:
    return state_dir / f"v{version}.safetensors", state_dir / f"v{version}.manifest"


def _remove(state_dir: Path, version: int) -> None:
    for p in _paths(state_dir, version):
        p.unlink(missing_ok=True)


def _remove_temporaries(state_dir: Path) -> None:
    for entry in state_dir.iterdir():
        if entry.name.startswith(".") and entry.name.endswith(".tmp"):
            entry.unlink(missing_ok=True)


def write_snapshot(state_dir: Path, snap: Snapshot, learner_peer_id: str, run_id: str) -> None:
    """Verify ``snap``, write it (weights, then manifest: the commit point) and remove every
    older pair. Blocking: call it in a worker thread. Raises ``ProtocolError`` if unverified."""
    verify_snapshot(snap.manifest, snap.path, learner_peer_id, run_id)
    state_dir.mkdir(parents=True, exist_ok=True)
    weights_path, manifest_path = _paths(state_dir, snap.version)
    if snap.path != weights_path:
        tmp = state_dir / f".{weights_path.name}.tmp"
        link_or_copy(snap.path, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, weights_path)
        fsync_dir(state_dir)
        if snap.path.parent == state_dir and snap.path.name.startswith("."):
            snap.path.unlink(missing_ok=True)  # the pending link of ``offer``
    atomic_write_bytes(manifest_path, wire.encode(snap.manifest))
    for version in _versions_on_disk(state_dir):
        if version != snap.version:
            _remove(state_dir, version)


def clear_snapshots(state_dir: Path) -> None:
    """Remove every snapshot pair and pending link (the learner went back to an older
    checkpoint or changed)."""
    for version in _versions_on_disk(state_dir):
        _remove(state_dir, version)
    if state_dir.is_dir():
        _remove_temporaries(state_dir)


def _read_pair(state_dir: Path, version: int) -> tuple[Manifest, Path]:
    """Strictly decoded manifest and the weights file (its size checked)."""
    weights_path, manifest_path = _paths(state_dir, version)
    if manifest_path.stat().st_size > limits.MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.OVERSIZED, "manifest file larger than any manifest")
    manifest = wire.decode(manifest_path.read_bytes(), expect=Manifest)
    assert isinstance(manifest, Manifest)
    if manifest.version != version:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, f"file v{version} holds a manifest of v{manifest.version}")
    if weights_path.stat().st_size != manifest.result_bytes:
        raise ProtocolError(ErrorCode.BAD_MANIFEST, "weights file size differs from the manifest's")
    return manifest, weights_path


def load_snapshot(state_dir: Path, learner_peer_id: str, run_id: str) -> Snapshot | None:
    """The newest snapshot in ``state_dir`` that verifies for this learner and run, or None.
    Pairs that fail (tampered, incomplete, other learner, other run) are deleted with a log line.
    Blocking: call it in a worker thread."""
    found = _versions_on_disk(state_dir)
    if not found:
        return None
    _remove_temporaries(state_dir)  # left by a write that was killed
    best: Snapshot | None = None
    for version in sorted(found, reverse=True):
        if best is not None:
            _remove(state_dir, version)  # older than the one we keep
            continue
        try:
            if found[version] != {"safetensors", "manifest"}:
                raise ProtocolError(ErrorCode.NOT_FOUND, "incomplete pair (interrupted write)")
            manifest, path = _read_pair(state_dir, version)
            verify_snapshot(manifest, path, learner_peer_id, run_id)
            best = Snapshot(manifest, path)
        except (ProtocolError, OSError) as exc:
            log.warning("discarding on-disk snapshot v%d in %s: %s", version, state_dir, exc)
            _remove(state_dir, version)
    return best


# --- the daemon's writer ---------------------------------------------------------------------


class SnapshotKeeper:
    """Keeps the newest offered snapshot on disk from a trio task (``run``), writing in a worker
    thread at most once per ``MIN_INTERVAL_S`` / ``DUTY_FACTOR`` × last write time; ``flush``
    writes the pending one now."""

    def __init__(self, state_dir: Path, run_id: str, *, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.state_dir = Path(state_dir)
        self.run_id = run_id
        self.min_interval_s = min_interval_s
        self.written = -1  # version on disk (written by us, or loaded at start)
        self.writes = 0
        self._pending: tuple[Snapshot, str] | None = None  # (snapshot, learner peer id)
        self._clear = False
        self._wake = trio.Event()
        self._lock = trio.Lock()  # one disk operation at a time
        self._next_write = 0.0  # trio clock time before which no periodic write starts

    async def load(self, learner_peer_id: str) -> Snapshot | None:
        """The verified on-disk snapshot for this learner and run (see ``load_snapshot``)."""
        async with self._lock:
            snap = await trio.to_thread.run_sync(load_snapshot, self.state_dir, learner_peer_id, self.run_id)
        if snap is not None:
            self.written = snap.version
        return snap

    def _stale(self, version: int) -> bool:
        return version <= self.written or (self._pending is not None and version <= self._pending[0].version)

    async def offer(self, manifest: Manifest, path: Path, learner_peer_id: str) -> None:
        """A newer verified version to keep (written later by ``run``, or by ``flush``): its file
        is hard-linked here now, so it outlives the relay's own name for it."""
        if self._stale(manifest.version):
            return
        pending = self.state_dir / f".v{manifest.version}.pending.tmp"

        def link() -> None:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            link_or_copy(path, pending)

        try:
            await trio.to_thread.run_sync(link)
        except OSError as exc:
            log.warning("could not keep snapshot v%d: %s", manifest.version, exc)
            return
        if self._stale(manifest.version):  # a newer one came while we linked
            await trio.to_thread.run_sync(pending.unlink, True)
            return
        old, self._pending = self._pending, (Snapshot(manifest, pending), learner_peer_id)
        self._clear = False
        self._wake.set()
        if old is not None:
            await trio.to_thread.run_sync(old[0].path.unlink, True)

    def discard(self) -> None:
        """Forget the pending snapshot and remove the one on disk (soon, in ``run``)."""
        self._pending = None  # its pending link is a temporary: removed with the rest
        self._clear = True
        self.written = -1
        self._wake.set()

    async def run(self) -> None:
        """Write what is offered, no more often than the policy allows. Runs until cancelled."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if not self._clear:
                await trio.sleep_until(self._next_write)
            await self._write_pending()

    async def flush(self) -> None:
        """Write the pending snapshot (or removal) now, whatever the interval."""
        await self._write_pending()

    async def _write_pending(self) -> None:
        async with self._lock:
            if self._clear:
                self._clear = False
                await trio.to_thread.run_sync(clear_snapshots, self.state_dir)
                log.info("removed the on-disk snapshot in %s", self.state_dir)
            pending, self._pending = self._pending, None
            if pending is None:
                return
            snap, learner = pending
            t0 = time.monotonic()
            try:
                await trio.to_thread.run_sync(write_snapshot, self.state_dir, snap, learner, self.run_id)
            except (ProtocolError, OSError) as exc:
                log.warning("could not keep snapshot v%d on disk: %s", snap.version, exc)
                return
            finally:
                spent = time.monotonic() - t0
                self._next_write = trio.current_time() + max(self.min_interval_s, DUTY_FACTOR * spent)
            if self._clear:  # discarded while we wrote: the next round removes it
                return
            self.written = snap.version
            self.writes += 1
            log.info("kept snapshot v%d on disk (%.3f s)", snap.version, spent)
