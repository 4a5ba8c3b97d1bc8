"""A node keeps its newest verified snapshot on disk: written atomically with its signed manifest,
loaded back only after verification (a flipped byte, another learner's signature or another run
is refused and discarded), and a restarted node daemon starts from it instead of re-downloading."""

from __future__ import annotations

import re
import signal
import tempfile
from pathlib import Path

import pytest
import torch
import trio
from swarm import Swarm

from echorl.node.state import (
    Snapshot,
    SnapshotKeeper,
    default_state_dir,
    load_snapshot,
    write_snapshot,
)
from echorl.protocol import delta, snapshot, wire
from echorl.protocol.errors import ProtocolError
from echorl.protocol.identity import Identity

RUN = "state-test"


def _weights(seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return snapshot.state_dict_to_safetensors({"a": torch.randn(64, 32, generator=g), "b": torch.randn(7, generator=g)})


_SRC = Path(tempfile.mkdtemp(prefix="echorl-test-snap-"))  # where a relay's store would hold the files


def _file(data: bytes) -> Path:
    path = _SRC / f"{len(list(_SRC.iterdir()))}.safetensors"
    path.write_bytes(data)
    return path


def _snap(learner: Identity, version: int = 3, seed: int = 0, run_id: str = RUN) -> Snapshot:
    data = _weights(seed)
    manifest, _ = snapshot.build_manifest(learner, run_id, version, version - 1, data, data, chunk_bytes=4096)
    return Snapshot(manifest, _file(data))


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_write_then_load_verified(tmp_path):
    learner = Identity.generate()
    first = _snap(learner, 3, seed=0)
    write_snapshot(tmp_path, first, learner.peer_id, RUN)
    assert (tmp_path / "v3.safetensors").stat().st_ino == first.path.stat().st_ino  # a link, not a copy
    write_snapshot(tmp_path, _snap(learner, 5, seed=1), learner.peer_id, RUN)
    assert _files(tmp_path) == ["v5.manifest", "v5.safetensors"]  # only the newest is kept
    got = load_snapshot(tmp_path, learner.peer_id, RUN)
    assert got is not None and got.version == 5 and got.data == _weights(1)
    assert wire.decode((tmp_path / "v5.manifest").read_bytes()) == got.manifest


def test_delta_manifest_keeps_the_result(tmp_path):
    learner = Identity.generate()
    old, new = _weights(0), _weights(1)
    payload = delta.encode_delta(old, new)
    manifest, _ = snapshot.build_manifest(learner, RUN, 4, 3, payload, new, kind="delta", base_version=3)
    write_snapshot(tmp_path, Snapshot(manifest, _file(new)), learner.peer_id, RUN)
    got = load_snapshot(tmp_path, learner.peer_id, RUN)
    assert got is not None and got.version == 4 and got.data == new and got.manifest.kind == "delta"
    with pytest.raises(ProtocolError):  # the delta payload is not the version's file
        write_snapshot(tmp_path, Snapshot(manifest, _file(payload)), learner.peer_id, RUN)


def test_flipped_byte_is_refused_and_discarded(tmp_path, caplog):
    learner = Identity.generate()
    write_snapshot(tmp_path, _snap(learner), learner.peer_id, RUN)
    path = tmp_path / "v3.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01
    path.write_bytes(bytes(raw))
    assert load_snapshot(tmp_path, learner.peer_id, RUN) is None
    assert _files(tmp_path) == []
    assert "discarding on-disk snapshot v3" in caplog.text and "digest mismatch" in caplog.text


@pytest.mark.parametrize("case", ["other_learner", "other_run", "garbage_manifest", "missing_weights"])
def test_foreign_or_broken_snapshot_is_refused(tmp_path, caplog, case):
    learner, other = Identity.generate(), Identity.generate()
    if case == "other_learner":  # validly signed, but not by the pinned learner
        write_snapshot(tmp_path, _snap(other), other.peer_id, RUN)
    elif case == "other_run":
        write_snapshot(tmp_path, _snap(learner, run_id="another-run"), learner.peer_id, "another-run")
    else:
        write_snapshot(tmp_path, _snap(learner), learner.peer_id, RUN)
        if case == "garbage_manifest":
            (tmp_path / "v3.manifest").write_bytes(b"\xc1not msgpack")
        else:
            (tmp_path / "v3.safetensors").unlink()
    assert load_snapshot(tmp_path, learner.peer_id, RUN) is None
    assert _files(tmp_path) == [] and "discarding on-disk snapshot v3" in caplog.text


def test_unverified_pair_is_never_written(tmp_path):
    learner, other = Identity.generate(), Identity.generate()
    with pytest.raises(ProtocolError):
        write_snapshot(tmp_path, _snap(other), learner.peer_id, RUN)
    assert not tmp_path.exists() or _files(tmp_path) == []


def test_keeper_writes_newest_and_flushes(tmp_path):
    learner = Identity.generate()

    async def main() -> None:
        keeper = SnapshotKeeper(tmp_path, RUN, min_interval_s=3600)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keeper.run)
            first = _snap(learner, 1, seed=1)
            await keeper.offer(first.manifest, first.path, learner.peer_id)
            with trio.fail_after(10):
                while keeper.written != 1:
                    await trio.sleep(0.01)
            for v in (2, 3):  # inside the interval: held back, only the newest is pending
                s = _snap(learner, v, seed=v)
                await keeper.offer(s.manifest, s.path, learner.peer_id)
            await trio.sleep(0.2)
            assert keeper.written == 1 and keeper.writes == 1
            await keeper.flush()
            assert keeper.written == 3 and keeper.writes == 2
            keeper.discard()
            await keeper.flush()
            assert _files(tmp_path) == []
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_default_state_dir_is_per_key_and_run(tmp_path):
    assert default_state_dir(tmp_path / "a.key", "run-1") == tmp_path / "state-a-run-1"
    assert default_state_dir(tmp_path / "b.key", "run-1") != default_state_dir(tmp_path / "a.key", "run-1")


# --- real processes ----------------------------------------------------------------------------


def _steps(swarm: Swarm) -> list[dict]:
    return [r for r in swarm.metrics() if r.get("step", 0) > 0]


def _stop(proc, log: Path) -> str:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    return log.read_text()


def test_restarted_node_starts_from_disk(swarm, tmp_path):
    swarm.start_learner("--steps", "0", "--staleness", "2", "--eval-every", "1000")
    log = tmp_path / "a.log"
    node = swarm.start_node("a")
    swarm.wait_for(
        lambda: len(_steps(swarm)) >= 4 and "kept snapshot v" in log.read_text(),
        what="4 steps and a snapshot on disk",
        timeout=150,
    )
    first = _stop(node, log)
    kept = int(re.findall(r"kept snapshot v(\d+) on disk", first)[-1])  # the last: written at exit
    assert kept >= 1 and "resumed from on-disk snapshot" not in first
    state_dir = tmp_path / "state-a-echorl-demo"
    assert (state_dir / f"v{kept}.safetensors").exists() and (state_dir / f"v{kept}.manifest").exists()
    log.rename(tmp_path / "a1.log")

    node = swarm.start_node("a")  # same key, so the same state dir
    swarm.wait_for(
        lambda: max(_steps(swarm)[-1]["per_node_version"].values(), default=-1) > kept,
        what="a newer version at the restarted node",
        timeout=120,
    )
    second = _stop(node, log)
    assert f"resumed from on-disk snapshot v{kept}" in second
    assert re.search(rf"joined run echorl-demo at learner version \d+ \(S=2\) holding v{kept}\b", second)
    assert "fetched directly" not in second  # no full direct fetch: only what is newer came
    loads = re.search(
        r"versions loaded: \{'relay': (\d+), 'fetch': (\d+), 'disk': 1\}; "
        rf"started from on-disk v{kept}\)",
        second,
    )
    assert loads and int(loads.group(1)) >= 1 and int(loads.group(2)) == 0, second[-2000:]


def test_state_dir_is_held_by_one_process_at_a_time(tmp_path):
    """A second node with the same key would share the state directory and clean the first one's
    store; the lock refuses it before it touches anything (found when a twin crashed its sibling)."""
    from echorl.node.state import lock_state_dir

    first = lock_state_dir(tmp_path / "state")
    assert first is not None
    assert lock_state_dir(tmp_path / "state") is None
    first.close()  # the process ended
    again = lock_state_dir(tmp_path / "state")
    assert again is not None
    again.close()
