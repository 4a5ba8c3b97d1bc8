"""Broadcast benchmark: N relay peers (separate processes) on loopback, every upload capped.

    python bench/broadcast.py --peers 16 --size-mb 8 --upload-mbps 20 --json
    python bench/broadcast.py --peers 32 --size-mb 8 --upload-mbps 20 --no-star --json

Runs the pipelined plan (striped by default, ``--shape tree`` for one k-ary tree) three times: a
first version that dials every edge (``tree_seconds_cold``), a second over the same plan and
connections (``tree_seconds_second``), and a third (``tree_seconds``: the steady state of a run,
every version over reused connections). At 1 GB x 8 peers the second varies most: its files take
new page-cache pages, which on a VM cost a host page fault each when the guest has not touched
them lately, and by the third the page cache likely holds the earlier versions and new pages come
from reclaim (docs/broadcast-notes.md, wave 5), and, unless
``--no-star``, one-to-many from the learner, in the same run, each as a full snapshot of random
bytes (no torch needed). Prints one JSON line: peers, bytes, chunk_bytes, depth, tree_seconds,
star_seconds, lower_bound_seconds (= W/B: one upload of the snapshot at the capped rate), and
CPU figures (cpu_s_per_gb_relayed: CPU of all processes during the tree phase / bytes received
by all peers). Memory: ``max_peer_rss_mb`` (the largest VmRSS any relay process reached during
the run, sampled from /proc/<pid>/status every 0.2 s) and ``learner_rss_mb`` (the same for this
process, which also generates the test versions), with the chunk cache each peer had
(``--chunk-cache-mb``); every peer's weights are files in a temporary directory (``--store-dir``).
``load_avg`` is the 1-minute load when the run started and ended (the machine may be shared).

    python bench/broadcast.py --peers 8 --size-mb 1024 --upload-mbps 400 --no-star --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import emit

from echorl.broadcast.broadcaster import Broadcaster, NodeInfo
from echorl.broadcast.relay_process import rss_mb
from echorl.net.host import HostConfig, open_host
from echorl.net.transport import UploadLimiter
from echorl.protocol.identity import Identity

CLK = os.sysconf("SC_CLK_TCK")


def fake_safetensors(n_bytes: int, seed: int) -> bytearray:
    """A valid safetensors file with one U8 tensor of ``n_bytes`` random bytes (built in place:
    one copy of the version in memory)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [n_bytes], "data_offsets": [0, n_bytes]}}).encode()
    header += b" " * (-len(header) % 8)
    out = bytearray(8 + len(header) + n_bytes)
    out[: 8 + len(header)] = len(header).to_bytes(8, "little") + header
    rng, step = np.random.default_rng(seed), 64 << 20
    for at in range(8 + len(header), len(out), step):
        n = min(step, len(out) - at)
        out[at : at + n] = rng.bytes(n)
    return out


async def sample_rss(pids: list[int], peaks: dict[str, float]) -> None:
    """Keep the largest VmRSS of the relay processes and of this process until cancelled."""
    while True:
        peaks["peers"] = max(peaks.get("peers", 0.0), *(rss_mb(p) for p in pids))
        peaks["learner"] = max(peaks.get("learner", 0.0), rss_mb(os.getpid()))
        await trio.sleep(0.2)


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK
        except (OSError, IndexError, ValueError):
            pass
    return total


def spawn_peers(n: int, learner_addr: str, mbps: float, stall_s: float, extra: list[str] | None = None):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = []
    for _ in range(n):
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "echorl.broadcast.relay_process",
                    "--learner",
                    learner_addr,
                    "--run-id",
                    "bench",
                    "--upload-mbps",
                    str(mbps),
                    "--stall-s",
                    str(stall_s),
                    *(extra or []),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                env=env,
                text=True,
            )
        )
    return procs


def read_ready(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:  # type: ignore[union-attr]
        obj = json.loads(line)
        if obj.get("event") == "ready":
            return obj
    raise RuntimeError("relay peer exited before it was ready")


async def run(args: argparse.Namespace) -> dict:
    size = int(args.size_mb * 1024 * 1024)
    chunk = int(args.chunk_kb * 1024) or None  # None: the learner's default, auto_chunk_bytes
    rate = args.upload_mbps * 1e6 / 8
    identity = Identity.generate()
    out: dict = {"load_avg_start": round(os.getloadavg()[0], 2)}
    cache = int(args.chunk_cache_mb * 2**20)
    store = Path(tempfile.mkdtemp(prefix="echorl-bench-", dir=args.store_dir or None))
    async with open_host(identity, HostConfig()) as host:
        bc = Broadcaster(
            host,
            identity,
            "bench",
            fanout=args.fanout,
            chunk_bytes=chunk,
            full_every=1,
            upload_limit=UploadLimiter.from_mbps(args.upload_mbps),
            shape=args.shape,
            done_timeout_s=args.timeout,
            direct=not args.no_direct,
            store_dir=store / "learner",
            cache_bytes=cache,
        )
        bc.install()
        nursery_cm = trio.open_nursery()
        nursery = await nursery_cm.__aenter__()
        await nursery.start(bc.run)
        t = time.perf_counter()
        procs = [
            spawn_peers(
                1,
                host.addrs[0],
                args.upload_mbps,
                args.stall_s,
                (["--no-direct"] if args.no_direct else [])
                + ["--store-dir", str(store / f"relay{i}"), "--chunk-cache-mb", str(args.chunk_cache_mb)],
            )[0]
            for i in range(args.peers)
        ]
        peaks: dict[str, float] = {}
        try:
            readies = []
            for p in procs:
                readies.append(await trio.to_thread.run_sync(read_ready, p))
            startup = time.perf_counter() - t
            nodes = [NodeInfo(r["peer_id"], True, tuple(r["addrs"])) for r in readies]
            pids = [p.pid for p in procs]
            nursery.start_soon(sample_rss, pids, peaks)
            await trio.sleep(1.0)  # let start-up CPU settle
            cold = await bc.publish(1, fake_safetensors(size, 3), nodes)  # first version: dials every edge
            await trio.sleep(0.5)
            second = await bc.publish(2, fake_safetensors(size, 4), nodes)  # connections reused
            data = fake_safetensors(size, 1)
            await trio.sleep(0.5)
            cpu0, own0 = cpu_seconds(pids), time.process_time()
            tree = await bc.publish(3, data, nodes)  # steady state
            cpu_tree = cpu_seconds(pids) - cpu0 + time.process_time() - own0
            out.update(
                peers=args.peers,
                bytes=len(data),
                chunk_bytes=bc.server.states[3].manifest.chunk_bytes,
                fanout=args.fanout,
                shape=args.shape,
                depth=tree.depth,
                upload_mbps=args.upload_mbps,
                tree_seconds=round(tree.seconds, 3),
                lower_bound_seconds=round(len(data) / rate, 3),
                tree_over_lower_bound=round(tree.seconds / (len(data) / rate), 3),
                tree_seconds_cold=round(cold.seconds, 3),
                tree_seconds_second=round(second.seconds, 3),
                cold_completed=len(cold.completed),
                cold_missing=len(cold.missing),
                cold_suspects=len(cold.suspects),
                cold_recovered_chunks=cold.recovered_chunks,
                tree_completed=len(tree.completed),
                tree_missing=len(tree.missing),
                tree_recovered_chunks=tree.recovered_chunks,
                cpu_seconds_tree=round(cpu_tree, 2),
                cpu_s_per_gb_relayed=round(cpu_tree / (len(data) * args.peers / 1e9), 2),
                build_seconds=round(tree.build_seconds, 3),
                startup_seconds=round(startup, 1),
                node_seconds_max=round(max(tree.node_seconds.values(), default=0.0), 3),
            )
            del data
            if not args.no_star:
                star = await bc.publish(4, fake_safetensors(size, 2), nodes, shape="star")
                out.update(
                    star_seconds=round(star.seconds, 3),
                    star_completed=len(star.completed),
                    star_over_tree=round(star.seconds / tree.seconds, 2),
                )
            else:
                out.update(star_seconds=None)
        finally:
            for p in procs:
                try:
                    p.stdin.close()  # type: ignore[union-attr]
                except OSError:
                    pass
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            nursery.cancel_scope.cancel()
            await nursery_cm.__aexit__(None, None, None)
            shutil.rmtree(store, ignore_errors=True)
    out.update(
        max_peer_rss_mb=round(peaks.get("peers", 0.0), 1),
        learner_rss_mb=round(peaks.get("learner", 0.0), 1),
        chunk_cache_mb=args.chunk_cache_mb,
        load_avg_end=round(os.getloadavg()[0], 2),
    )
    out["transport"] = "libp2p" if args.no_direct else "direct-tcp"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=16)
    ap.add_argument("--size-mb", type=float, default=8.0)
    ap.add_argument("--upload-mbps", type=float, default=20.0)
    ap.add_argument("--fanout", type=int, default=4)
    ap.add_argument("--chunk-kb", type=float, default=0.0, help="0: auto_chunk_bytes (the learner's default)")
    ap.add_argument("--shape", choices=["striped", "tree"], default="striped")
    ap.add_argument("--no-star", action="store_true")
    ap.add_argument("--stall-s", type=float, default=30.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--no-direct", action="store_true", help="chunks over libp2p (Noise+yamux) only")
    ap.add_argument("--chunk-cache-mb", type=float, default=64.0, help="each peer's chunk cache (weights on disk)")
    ap.add_argument("--store-dir", default="", help="parent of the peers' weight files (default: the tmp dir)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = trio.run(run, args)
    emit(out, args.json)


if __name__ == "__main__":
    main()
