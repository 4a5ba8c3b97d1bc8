"""The peers of ``bench/versus.py``, one role per OS process, each run inside its own lab namespace.

    python bench/versus_peers.py ROLE [options]

Every role prints JSON lines on stdout: ``ready`` once it can take part, ``done`` (``t``: wall
clock, ``digest``: SHA-256 of the copy it holds) once it holds the whole payload, ``start`` (the
origins: ``t0``) when the distribution begins. Origins wait for one line on stdin ("go") before
they start; a Lattica receiver reads the block list from stdin. Roles:

- ``o2m-origin`` / ``o2m-recv``: one-to-many, the floor: the origin sends the file to every
  receiver over its own TCP connection, all at once.
- ``sc-origin`` / ``sc-middle`` / ``sc-client``: Shardcast 0.3.2 through its own API
  (``OriginServer.broadcast``, ``MiddleNode``, ``ClientNode.download_version``). Two fixed paths
  it writes (``/tmp/dummy.bin``, ``site-packages/temp_distribution.txt``) are made private per
  process, since here all its processes share one file system.
- ``lat-origin`` / ``lat-recv``: Lattica 1.0.21: the origin ``put_block``s the payload in blocks;
  receivers ``get_block`` every block (bitswap: from whichever connected peer has it).

echorl's peers are ``bench/netlab.py --_broadcaster`` and ``echorl.broadcast.relay_process``.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

IO_TIMEOUT_S = 600.0


def emit(**kw: object) -> None:
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def wait_go() -> None:
    """Block until the parent writes a line (its "go"); exit if it went away."""
    if not sys.stdin.readline():
        sys.exit(0)


def private_tmp(*keep: str) -> None:
    """A private /tmp for this process: Shardcast's downloader writes the fixed path
    /tmp/dummy.bin on start; processes of one machine would race on it (on separate machines, as
    it is meant to run, they do not). ``ip netns exec`` gave this process its own mount namespace.
    What this process still needs under the old /tmp (the interpreter's environment, a virtualenv
    made there, the installed package, the checkout, ``keep``) is bound back into the new one at
    the same paths: a tmpfs over all of /tmp hid a virtualenv there (``No module named
    'shardcast'``, and the race silently lost a competitor)."""
    spec = importlib.util.find_spec("shardcast")
    needed = [sys.prefix, sys.exec_prefix, sys.base_prefix, str(Path(__file__).resolve().parents[1]), *keep]
    if spec is not None and spec.origin:
        needed.append(str(Path(spec.origin).parent))
    under = sorted({os.path.realpath(p) for p in needed if p and os.path.realpath(p).startswith("/tmp/")})
    tops = [p for p in under if not any(p.startswith(q + "/") for q in under if q != p)]
    old = ""
    if tops:  # the old /tmp stays reachable at a private path while the tmpfs covers /tmp
        old = tempfile.mkdtemp(prefix="versus-oldtmp-", dir="/var/tmp")
        subprocess.run(["mount", "--bind", "/tmp", old], check=True, timeout=30)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", "/tmp"], check=True, timeout=30)
    for path in tops:
        os.makedirs(path, exist_ok=True)
        subprocess.run(["mount", "--bind", old + path[len("/tmp") :], path], check=True, timeout=30)


# --- one-to-many ------------------------------------------------------------------------------
def o2m_origin(args: argparse.Namespace) -> None:
    srv = socket.create_server(("0.0.0.0", args.port), backlog=256)
    emit(event="ready")
    wait_go()
    emit(event="start", t0=time.time())

    def send(conn: socket.socket) -> None:
        with conn, open(args.file, "rb") as f:
            conn.settimeout(IO_TIMEOUT_S)
            conn.sendfile(f)

    while True:
        conn, _ = srv.accept()
        threading.Thread(target=send, args=(conn,), daemon=True).start()


def o2m_recv(args: argparse.Namespace) -> None:
    emit(event="ready")
    wait_go()
    h, n = hashlib.sha256(), 0
    deadline = time.monotonic() + 30
    while True:
        try:
            sock = socket.create_connection((args.origin, args.port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with sock:
        sock.settimeout(IO_TIMEOUT_S)
        while chunk := sock.recv(1 << 20):
            h.update(chunk)
            n += len(chunk)
    emit(event="done", t=time.time(), digest=h.hexdigest(), bytes=n)


# --- Shardcast --------------------------------------------------------------------------------
def sc_origin(args: argparse.Namespace) -> None:
    private_tmp(args.dir)
    from shardcast import OriginServer

    Path(args.dir, "data1.bin").write_bytes(b"x" * 1024)  # the probe file its downloader fetches first
    origin = OriginServer(args.dir, args.port)
    emit(event="ready")
    wait_go()
    emit(event="start", t0=time.time())
    origin.broadcast(args.file, args.shard_bytes)
    while sys.stdin.readline():
        pass


def sc_middle(args: argparse.Namespace) -> None:
    """A middle node that is also a receiver: it holds a copy once it has every shard."""
    private_tmp(args.dir)
    from shardcast import MiddleNode

    Path(args.dir).mkdir(parents=True, exist_ok=True)
    Path(args.dir, "data1.bin").write_bytes(b"x" * 1024)
    node = MiddleNode([f"http://{args.origin}:{args.port}"], args.dir, args.port, check_interval=1)
    emit(event="ready")
    while "v1" not in node.processed_versions:
        time.sleep(0.02)
    shards = sorted(Path(args.dir, "v1").glob("shard_*.bin"))
    h = hashlib.sha256()
    for s in shards:
        with open(s, "rb") as f:
            while b := f.read(1 << 20):
                h.update(b)
    emit(event="done", t=time.time(), digest=h.hexdigest(), shards=len(shards))
    while sys.stdin.readline():
        pass


def sc_client(args: argparse.Namespace) -> None:
    private_tmp(args.dir)
    # its ClientNode writes the distribution file next to the installed package
    # (site-packages/temp_distribution.txt): clients of one machine would race on it, so this
    # one imports its own copy of the package from its own directory
    import shutil

    origin = Path(importlib.util.find_spec("shardcast").origin).parent  # type: ignore[union-attr, arg-type]
    private = Path(args.dir) / "pkg"
    shutil.copytree(origin, private / "shardcast", dirs_exist_ok=True)
    sys.path.insert(0, str(private))
    from shardcast import ClientNode

    client = ClientNode([f"http://{m}:{args.port}" for m in args.middles.split(",")], args.dir)
    emit(event="ready")
    out = None
    while out is None:  # as a user would: the version is listed once the middle node has it; retry
        if "v1" in client.list_available_versions():
            out = client.download_version("v1", str(Path(args.dir) / "copy.bin"))
        if out is None:
            time.sleep(0.2)
    emit(event="done", t=time.time(), digest=sha256_file(Path(out)))


# --- Lattica ----------------------------------------------------------------------------------
def _lattica(listen_port: int, bootstrap: list[str], storage: Path) -> object:
    from lattica import Lattica

    return (
        Lattica.builder()
        .with_listen_addrs([f"/ip4/0.0.0.0/tcp/{listen_port}"])
        .with_bootstraps(bootstrap)
        .with_mdns(False)
        .with_upnp(False)
        .with_storage_path(str(storage / "blocks"))
        .with_dht_db_path(str(storage / "dht"))
        .build()
    )


def lat_origin(args: argparse.Namespace) -> None:
    node = _lattica(args.port, [], Path(args.dir))
    emit(event="ready", addr=f"/ip4/{args.ip}/tcp/{args.port}/p2p/{node.peer_id()}")
    wait_go()
    emit(event="start", t0=time.time())
    data, size = Path(args.file).read_bytes(), args.block_bytes
    cids = [node.put_block(data[i : i + size]) for i in range(0, len(data), size)]
    emit(event="blocks", cids=cids)
    while sys.stdin.readline():
        pass


def lat_recv(args: argparse.Namespace) -> None:
    """``--bootstrap``: the origin and every receiver started before this one, so each receiver
    is connected to all the others and bitswap can ask them all for a block."""
    node = _lattica(args.port, args.bootstrap.split(","), Path(args.dir))
    emit(event="ready", addr=f"/ip4/{args.ip}/tcp/{args.port}/p2p/{node.peer_id()}")
    cids: list[str] = json.loads(sys.stdin.readline())
    order = list(range(len(cids)))
    random.Random(args.seed).shuffle(order)  # receivers ask for different blocks first, so they can trade

    def fetch(i: int) -> bytes:
        for _ in range(5):
            try:
                _, block = node.get_block(cids[i], timeout_secs=int(IO_TIMEOUT_S))
                return bytes(block)
            except RuntimeError:
                time.sleep(0.2)
        raise RuntimeError(f"block {i} not received")

    with ThreadPoolExecutor(args.concurrency) as pool:
        blocks = dict(zip(order, pool.map(fetch, order)))
    h = hashlib.sha256()
    for i in range(len(cids)):
        h.update(blocks[i])
    emit(event="done", t=time.time(), digest=h.hexdigest())
    while sys.stdin.readline():  # keep serving blocks to the others until the parent ends the run
        pass


ROLES = {
    "o2m-origin": o2m_origin,
    "o2m-recv": o2m_recv,
    "sc-origin": sc_origin,
    "sc-middle": sc_middle,
    "sc-client": sc_client,
    "lat-origin": lat_origin,
    "lat-recv": lat_recv,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=sorted(ROLES))
    ap.add_argument("--file", default="")
    ap.add_argument("--dir", default="")
    ap.add_argument("--ip", default="")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--origin", default="")
    ap.add_argument("--middles", default="")
    ap.add_argument("--bootstrap", default="")
    ap.add_argument("--shard-bytes", type=int, default=50_000_000)
    ap.add_argument("--block-bytes", type=int, default=1 << 20)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    ROLES[args.role](args)


if __name__ == "__main__":
    main()
