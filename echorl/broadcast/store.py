"""The one store of weight chunks a peer holds, for every use, on disk: ``WeightStore`` (the
peer's store directory and its chunk cache), ``VersionState`` (one version's chunks as they are
verified, what plan children are streamed) and ``HeldChain`` (the verified versions kept after
that: the newest full snapshot and the deltas after it, served to peers catching up and to a
node's direct fetch; on the learner also the older versions the spot checker may still need).

A version's payload is one file (chunk i at offset i × ``chunk_bytes``), written chunk by chunk
as each is verified and read back by offset (``broadcast/files.py``); a delta's rebuilt result
is a second file. A file held by a reader (``WeightStore.reading``: a chunk read from disk, a
version the node is loading) is not removed until the reader is done. Memory holds only the
``ChunkCache`` (encoded ``Chunk`` frame bodies keyed by their digest: what a relay forwards while
its children keep up), bounded by ``cache_bytes``, whatever the model's size. Both the learner's
``Broadcaster`` and every node's ``Relay`` serve from it (``broadcast/chunk_server.py``).
"""

from __future__ import annotations

import itertools
import os
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import trio

from echorl.broadcast.adoption import adoption_slots, is_nephew, may_adopt
from echorl.broadcast.files import ChunkCache, create_file, read_at, write_at
from echorl.protocol import delta as delta_mod
from echorl.protocol import snapshot, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import Chunk, Manifest, PlanAnnounce, PlanMember, StreamRate
from echorl.protocol.plan import BroadcastPlan, PlanPeer, Stripe, plan_broadcast

DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
#: a chunk write this small runs on the loop, followed by a checkpoint: a page-cache pwrite of
#: 64 KiB takes tens of microseconds, the hop to a worker thread and back cost more (11 % of all
#: relay samples in the 32-peer bench, docs/broadcast-notes.md). The checkpoint keeps what the
#: hop gave for free: the relay's forwarders run between two of its chunks, so it never reads
#: far ahead of them and evicts chunks from its cache before they are streamed on. Larger writes
#: (versions of 100s of MB, where the kernel may throttle dirty pages) still go to a thread.
INLINE_WRITE_BYTES = 64 * 1024
_OURS = re.compile(r"^v\d+-\d+\.(payload|safetensors)$")
_TMP_STORE = re.compile(r"^echorl-store-(\d+)-")
STALE_TMP_STORE_S = 600.0  # a dead process's temporary store is removed once untouched this long
_uid = itertools.count()


def plan_of(ann: PlanAnnounce) -> BroadcastPlan:
    """The relay plan every node derives from a (verified) announcement."""
    return plan_for(ann.learner_peer_id, ann.members, ann.shape, ann.fanout, ann.seed)


def plan_for(learner: str, members: Sequence[PlanMember], shape: str, fanout: int, seed: int) -> BroadcastPlan:
    """The plan of an announcement with these fields (the learner plans before it signs)."""
    if shape == "star":
        peers = tuple(sorted(m.peer_id for m in members))
        return BroadcastPlan(learner, max(len(peers), 1), (Stripe(0, {learner: peers}),), peers)
    plan_peers = [PlanPeer(m.peer_id, m.reachable, bool(m.pushes), m.weight) for m in members]
    return plan_broadcast(learner, plan_peers, fanout, seed, striped=shape == "striped")


def chunk_body(d: bytes, data: bytes) -> bytes:
    """The ``Chunk`` frame body of chunk ``d`` (what a parent forwards)."""
    return wire.encode(Chunk(digest=d, data=bytes(data)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, not ours to signal
        return True
    return True


def remove_stale_tmp_stores(parent: Path | None = None, now: float | None = None) -> list[Path]:
    """Temporary stores (``echorl-store-<pid>-*``) left by processes that died without cleaning
    up (SIGKILL, OOM, power loss): removed when their process is gone and they have not been
    touched for ``STALE_TMP_STORE_S`` (a process in another PID namespace sharing this temp
    directory writes its store at least that often while it receives versions)."""
    import shutil

    parent = Path(parent or tempfile.gettempdir())
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        m = _TMP_STORE.match(entry.name)
        try:
            stale = bool(m) and entry.is_dir() and now - entry.stat().st_mtime > STALE_TMP_STORE_S
        except OSError:
            continue
        if stale and int(m.group(1)) != os.getpid() and not _alive(int(m.group(1))):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


class WeightStore:
    """A peer's weight files and chunk cache. ``directory``: where the files live (a fresh
    temporary directory, removed with the store, if None; a given one is emptied of this
    module's files first: they belonged to an earlier process)."""

    def __init__(self, directory: Path | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self._tmp = None
        if directory is None:
            remove_stale_tmp_stores()
            self._tmp = tempfile.TemporaryDirectory(prefix=f"echorl-store-{os.getpid()}-")
            directory = Path(self._tmp.name)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cache = ChunkCache(cache_bytes)
        self._lock = threading.Lock()  # readers: counted from the loop and from worker threads
        self._readers: Counter[Path] = Counter()
        self._remove(set())

    def new_path(self, version: int, kind: str = "payload") -> Path:
        """A file name no other version state uses (a version may be received twice)."""
        return self.dir / f"v{version}-{next(_uid)}.{kind}"

    @contextmanager
    def reading(self, path: Path):
        """While inside, ``collect`` leaves ``path`` alone (a reader holds it). Usable from the
        loop and from worker threads."""
        with self._lock:
            self._readers[path] += 1
        try:
            yield
        finally:
            with self._lock:
                self._readers[path] -= 1
                if self._readers[path] <= 0:
                    del self._readers[path]

    async def read(self, path: Path, offset: int, n: int) -> bytes:
        """``read_at`` in a worker thread, ``path`` held for the read."""
        with self.reading(path):
            return await trio.to_thread.run_sync(read_at, path, offset, n)

    def _remove(self, live: set[Path]) -> list[Path]:
        with self._lock:
            held = set(self._readers)
        removed = []
        for entry in self.dir.iterdir():
            if _OURS.match(entry.name) and entry not in live and entry not in held:
                entry.unlink(missing_ok=True)
                removed.append(entry)
        return removed

    async def collect(self, live: set[Path]) -> None:
        """Remove this store's files that nothing uses any more (in a worker thread)."""
        await trio.to_thread.run_sync(self._remove, live)

    def disk_bytes(self, paths: set[Path]) -> int:
        return sum(p.stat().st_size for p in paths if p.exists())

    async def body(self, path: Path, d: bytes, offset: int, size: int) -> bytes:
        """The frame body of chunk ``d`` stored at ``offset`` of ``path``: from the cache, else
        read and encoded in a worker thread (and cached)."""
        body = self.cache.get(d)
        if body is None:
            with self.reading(path):
                body = await trio.to_thread.run_sync(lambda: chunk_body(d, read_at(path, offset, size)))
            self.cache.put(d, body)
        return body


class VersionState:
    """One version in flight at one peer: chunks as they are verified, waiters woken per chunk.
    The payload is the file ``path``; ``have[i]`` says chunk i is in it (verified). ``plan``: the
    announcement's plan where the caller computed it already (the learner plans before it signs)."""

    def __init__(self, ann: PlanAnnounce, me: str, store: WeightStore, plan: BroadcastPlan | None = None) -> None:
        self.announce = ann
        self.manifest = ann.manifest
        self.version = ann.version
        self.plan = plan_of(ann) if plan is None else plan
        self.me = me
        self.store = store
        self.path = store.new_path(ann.version)
        self.n = len(self.manifest.chunks)
        self.n_stripes = len(self.plan.stripes)
        self.have = bytearray(self.n)
        self.by_digest: dict[bytes, list[int]] = {}
        for i, ref in enumerate(self.manifest.chunks):
            self.by_digest.setdefault(ref.digest, []).append(i)
        self._up = [st.parent_of() for st in self.plan.stripes]  # per stripe: member -> its parent
        self.parents = {s: up.get(me) for s, up in enumerate(self._up)}
        self.children = {s: st.children.get(me, ()) for s, st in enumerate(self.plan.stripes)}
        self._adopted: dict[int, set[str]] = {}  # stripe -> members streamed to off the plan
        self._nephews: dict[int, int] = {}  # stripe -> how many of those are nephews (``adoption_slots``)
        self._orders: dict[int, dict[str, int]] = {}  # stripe -> breadth-first order (asked for on adoption)
        self._changed = trio.Event()
        self.done = trio.Event()
        self.started = time.monotonic()
        self._opened = False
        self._open_lock = trio.Lock()
        self._streamed: dict[int, list[float]] = {}  # stripe -> [transit at first chunk, bytes, seconds since]

    async def open(self) -> None:
        """Create the payload file (its full size, sparse) before the first chunk (once: the
        stripes' first chunks arrive together)."""
        async with self._open_lock:
            if not self._opened:
                await trio.to_thread.run_sync(create_file, self.path, self.manifest.payload_bytes)
                self._opened = True

    def offset(self, i: int) -> int:
        return i * self.manifest.chunk_bytes

    def stripe_indices(self, s: int) -> range:
        return range(s, self.n, self.n_stripes)

    def has(self, i: int) -> bool:
        return bool(self.have[i])

    def index_of(self, d: bytes) -> int | None:
        """A held chunk's index, or None."""
        idx = self.by_digest.get(d)
        return idx[0] if idx and self.have[idx[0]] else None

    def verify(self, d: bytes, data: bytes | memoryview) -> None:
        """Raise BAD_CHUNK unless ``data`` is the chunk the manifest names ``d``."""
        idx = self.by_digest.get(d)
        if not idx:
            raise ProtocolError(ErrorCode.BAD_CHUNK, "digest not in manifest")
        if len(data) != self.manifest.chunks[idx[0]].size or snapshot.digest(data) != d:
            raise ProtocolError(ErrorCode.BAD_CHUNK, "chunk bytes do not match their digest")

    async def put(self, d: bytes, data: bytes, body: bytes | None = None) -> bool:
        """Store a chunk already verified against ``d`` (written at each of its offsets, on the
        loop if small, else in a worker thread; its frame body cached); True if new. Wakes all
        waiters."""
        idx = self.by_digest.get(d)
        if not idx or self.have[idx[0]]:
            return False
        await self.open()

        def write() -> None:
            for i in idx:
                write_at(self.path, self.offset(i), data)

        if len(data) * len(idx) <= INLINE_WRITE_BYTES:
            write()
            await trio.lowlevel.checkpoint()
        else:
            await trio.to_thread.run_sync(write)
        if self.have[idx[0]]:
            return False
        if body is None or not body.endswith(data):
            body = None
        self.store.cache.put(d, body if body is not None else chunk_body(d, data))
        for i in idx:
            self.have[i] = 1
        self._wake()
        return True

    async def fill(self, payload: bytes) -> None:
        """The whole payload at once (the learner's own version), already cut per the manifest."""
        await trio.to_thread.run_sync(write_at, self.path, 0, payload)
        self._opened = True
        self.have[:] = b"\x01" * self.n
        self._wake()

    def note_streamed(self, s: int, nbytes: int, transit_s: float) -> None:
        """A chunk of ``nbytes`` of stripe ``s`` came from its plan parent, whose stream has
        been in transit ``transit_s`` so far (each frame's first byte to its last; the waits
        between frames, a parent waiting for its own feed, do not count)."""
        entry = self._streamed.setdefault(s, [transit_s, -nbytes, 0.0])
        entry[1] += nbytes
        entry[2] = transit_s - entry[0]

    def streams(self) -> list[StreamRate] | None:
        """What came from each plan parent, per stripe, after its first chunk, and its frames'
        transit seconds (``BroadcastDone.streams``; None: no stripe got past its first chunk)."""
        out = [
            StreamRate(stripe=s, bytes=int(b), seconds=t) for s, (_, b, t) in sorted(self._streamed.items()) if b > 0
        ]
        return out or None

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def body(self, i: int) -> bytes:
        ref = self.manifest.chunks[i]
        return await self.store.body(self.path, ref.digest, self.offset(i), ref.size)

    async def wait_for(self, i: int) -> None:
        while not self.have[i]:
            await self._changed.wait()

    def ancestors(self, s: int) -> list[str]:
        """This peer's ancestors in stripe ``s``, its plan parent first, the learner last."""
        return list(self._up_from(s, self.me))

    def adopt(self, s: int, peer: str) -> bool:
        """Whether to stream stripe ``s`` to ``peer``: a plan child; or, when its own parent
        failed (``broadcast/adoption.py``), a member after this peer in the stripe's
        breadth-first order (``may_adopt``): per stripe at most ``fanout`` descendants and
        later siblings (the learner: anyone; an extra copy of a stripe at most) and
        ``adoption_slots`` nephews, whatever a hostile member asks."""
        if peer in self.children.get(s, ()):
            return True
        adopted = self._adopted.setdefault(s, set())
        if peer in adopted:
            return True
        if not may_adopt(self._order(s), self.me, peer):
            return False
        if not is_nephew(self._up[s], self.plan.learner, self.me, peer):
            if len(adopted) - self._nephews.get(s, 0) >= self.plan.fanout:
                return False
        elif self._nephews.get(s, 0) < adoption_slots(self.plan, self.me):
            self._nephews[s] = self._nephews.get(s, 0) + 1
        else:
            return False
        adopted.add(peer)
        return True

    def _order(self, s: int) -> dict[str, int]:
        if s not in self._orders:
            self._orders[s] = self.plan.stripes[s].order_of(self.plan.learner)
        return self._orders[s]

    def _up_from(self, s: int, peer: str) -> Iterator[str]:
        """``peer``'s ancestors in stripe ``s``, nearest first (a plan is a tree: bounded anyway)."""
        up = self._up[s].get(peer)
        for _ in range(len(self.plan.peers) + 1):
            if up is None:
                return
            yield up
            up = self._up[s].get(up)

    def held_prefix(self, s: int) -> int:
        """How many of stripe ``s``'s chunks, in stripe order, this peer holds before the
        first it lacks (``Subscribe.skip`` when it asks another peer for the rest)."""
        n = 0
        for i in self.stripe_indices(s):
            if not self.have[i]:
                break
            n += 1
        return n

    def stripe_complete(self, s: int) -> bool:
        return all(self.have[i] for i in self.stripe_indices(s))

    @property
    def complete(self) -> bool:
        return all(self.have)

    def missing(self) -> int:
        return self.n - sum(self.have)


class HeldChain:
    """Verified versions held after their broadcast: runs of a full snapshot and the deltas after
    it, oldest first, each as its payload file. ``retain`` (versions) keeps older runs while a
    version within ``retain`` of the newest still needs them (the learner: S, so every version a
    rollout may be sampled with can be rebuilt for a spot check); 0 keeps only the newest run (a
    relay).

    ``entries`` is replaced, never mutated, so a worker thread may read a snapshot of it."""

    def __init__(self, retain: int = 0) -> None:
        self.retain = max(0, retain)
        self.entries: list[tuple[Manifest, Path, dict[bytes, int]]] = []

    def hold(self, manifest: Manifest, path: Path) -> None:
        """Add a verified version's payload file."""
        index = {}
        for i, ref in enumerate(manifest.chunks):
            index.setdefault(ref.digest, i)
        if manifest.kind == "full" or (self.entries and self.entries[-1][0].version == manifest.base_version):
            entries = self.entries + [(manifest, path, index)]
        else:
            entries = []  # a delta we cannot chain: serve nothing rather than a broken chain
        self.entries = self._trimmed(entries)

    def _trimmed(self, entries: list) -> list:
        if not entries:
            return entries
        cutoff = entries[-1][0].version - self.retain
        fulls = [i for i, e in enumerate(entries) if e[0].kind == "full"]
        older = [i for i in fulls if entries[i][0].version <= cutoff]
        return entries[(older[-1] if older else fulls[0]) :]

    def clear(self) -> None:
        self.entries = []

    @property
    def version(self) -> int:
        return self.entries[-1][0].version if self.entries else -1

    def paths(self) -> set[Path]:
        return {path for _, path, _ in self.entries}

    def newest_run(self) -> list[Manifest]:
        """The newest full snapshot's manifest and every delta after it (what catch-up serves)."""
        manifests = [e[0] for e in self.entries]
        start = max((i for i, m in enumerate(manifests) if m.kind == "full"), default=len(manifests))
        return manifests[start:]

    def manifest(self, version: int) -> Manifest | None:
        return next((e[0] for e in reversed(self.entries) if e[0].version == version), None)

    def locate(self, d: bytes) -> tuple[Path, int, int] | None:
        """(file, offset, size) of chunk ``d`` in the newest held version that has it."""
        for m, path, index in reversed(self.entries):
            i = index.get(d)
            if i is not None:
                return path, i * m.chunk_bytes, m.chunks[i].size
        return None

    def version_bytes(self, version: int) -> bytes | None:
        """``version``'s safetensors file rebuilt in memory from the held files (the full
        snapshot before it, then each delta), or None if not held. Blocking: a worker thread."""
        entries = self.entries
        at = next((i for i, e in enumerate(entries) if e[0].version == version), None)
        if at is None:
            return None
        start = max(i for i in range(at + 1) if entries[i][0].kind == "full")
        result: bytes | None = None
        try:
            for m, path, _ in entries[start : at + 1]:
                payload = read_at(path, 0, m.payload_bytes)
                result = payload if m.kind == "full" else delta_mod.apply_delta(result, payload)  # type: ignore[arg-type]
                snapshot.verify_result(m, result)
        except (OSError, ProtocolError):
            return None
        return result


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` holds ``src``'s bytes: a hard link (no second copy) where the file system allows."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        import shutil

        shutil.copyfile(src, dst)
