"""``echorl doctor``: can this machine be a node of that run? One row per check, pass/warn/fail.

Checks, in order (a failed address or dial ends the network checks): the bootstrap address
parses; the learner answers a dial (with the cause if not) and a ping (RTT); it serves the run;
where this machine is from the learner and whether it can dial us back (``DIALBACK``): the same
machine, the same network (it sees one of our own addresses: no NAT between us) or behind NAT
(then not dialable: this node relays by dialling reachable peers); download throughput from the
learner (the newest full snapshot's manifest by catch-up, and as many verified chunks as fit in a
few seconds; the learner serves weights only to joined peers, so the doctor joins as a probe,
``PROBE_ENGINE``, which the learner never counts as a node: no lease, not in its status, ledger,
summary or metrics, no liveness pings); our clock is not behind the learner's (the manifest must
not come from the future, a one-sided check: joins outside ±MAX_CLOCK_SKEW_S are refused); the
key file, by the rules ``echorl node`` loads it with; free disk for weights; the torch device.
``--json`` prints one object. Exit 0 if nothing failed, 1 otherwise, 2 for a bad address.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import trio


@dataclass
class Row:
    check: str
    status: str  # "pass" | "warn" | "fail"
    detail: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", required=True, help="the learner's multiaddr (/ip4/…/tcp/…/p2p/<id>)")
    p.add_argument("--run-id", dest="run_id", default="echorl-demo", help="the run to check")
    p.add_argument("--key", default=os.path.expanduser("~/.config/echorl/node.key"), help="the node's key file")
    p.add_argument(
        "--download-seconds",
        dest="download_seconds",
        type=float,
        default=4.0,
        help="how long to measure download throughput",
    )
    p.add_argument("--json", action="store_true", help="print one machine-readable object")


def run(args: argparse.Namespace) -> int:
    from echorl.net.addrs import AddressError, parse_peer_addr

    try:
        args.bootstrap = parse_peer_addr(args.bootstrap)
    except AddressError as exc:
        print(f"echorl doctor: {exc}", file=sys.stderr)
        return 2
    rows = trio.run(_network_checks, args) + _local_checks(args)
    ok = all(r.status != "fail" for r in rows)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [asdict(r) for r in rows]}))
    else:
        width = max(len(r.check) for r in rows)
        for r in rows:
            print(f"{r.status.upper():4}  {r.check:<{width}}  {r.detail}")
    return 0 if ok else 1


async def _network_checks(args: argparse.Namespace) -> list[Row]:
    from echorl.net.host import HostConfig, PeerUnavailable, open_host
    from echorl.protocol.identity import Identity

    rows = [Row("address", "pass", args.bootstrap)]
    async with open_host(Identity.generate(), HostConfig(listen="/ip4/0.0.0.0/tcp/0")) as host:
        try:
            learner = await host.connect(args.bootstrap, timeout=10.0)
        except PeerUnavailable as exc:
            rows.append(Row("dial", "fail", getattr(exc, "reason", str(exc))))
            return rows
        rtts = []
        for _ in range(3):
            try:
                rtts.append(await host.ping(learner, timeout=5.0))
            except PeerUnavailable:
                pass
        rtt = statistics.median(rtts) * 1000 if rtts else None
        rows.append(
            Row(
                "dial",
                "pass" if rtts else "warn",
                f"connected; ping {rtt:.1f} ms" if rtt is not None else "connected; no ping answer",
            )
        )
        rows.append(await _run_row(host, learner, args.run_id))
        rows.append(await _reachability_row(host, learner, args.bootstrap))
        rows += await _download_rows(host, learner, args.run_id, args.download_seconds)
    return rows


async def _run_row(host: Any, learner: str, run_id: str) -> Row:
    from echorl.net.host import PeerUnavailable, RemoteError
    from echorl.protocol import routes
    from echorl.protocol.messages import Status, StatusRequest

    try:
        status = await host.request(learner, routes.STATUS, StatusRequest(), expect=Status, timeout=10.0)
    except (PeerUnavailable, RemoteError) as exc:
        return Row("run", "fail", f"the peer does not answer status: {exc}")
    if status.run_id != run_id:
        return Row("run", "fail", f"the learner serves run {status.run_id!r}, not {run_id!r} (--run-id)")
    return Row(
        "run",
        "pass",
        f"run {status.run_id} at version {status.learner.get('version')}, {len(status.peers)} nodes joined",
    )


NOT_REACHABLE = (
    "not directly reachable (behind NAT or a firewall): joins and works; in the broadcast it "
    "relays by dialling reachable peers; --announce a forwarded port to be dialable"
)


async def _reachability_row(host: Any, learner: str, bootstrap: str) -> Row:
    """Ask the learner to dial us back at our listen addresses (the test that decides whether
    we may be dialled as a broadcast parent), and say where we are from it: the same machine,
    the same network (it sees one of our own addresses: no NAT between us) or behind NAT."""
    from echorl.net.host import PeerUnavailable, RemoteError
    from echorl.protocol import routes
    from echorl.protocol.messages import DialBackRequest, DialBackResult

    with trio.move_on_after(3.0):
        while not host.observed_addrs():
            await trio.sleep(0.1)
    seen = host.observed_addrs()
    try:
        reply = await host.request(
            learner, routes.DIALBACK, DialBackRequest(addrs=_dial_back_addrs(host)), expect=DialBackResult, timeout=15.0
        )
    except (PeerUnavailable, RemoteError) as exc:
        return _observed_row(seen, f"the learner does not dial back ({exc})")
    assert isinstance(reply, DialBackResult)
    return _placed_row(reply.reachable, reply.seen_ip, bootstrap, seen, host.addrs[:4])


def _dial_back_addrs(host: Any) -> list[str]:
    """Our advertised addresses, plus loopback on the same port: we listen on every interface,
    and a learner on this machine sees us at 127.0.0.1 (it dials only the address it sees)."""
    from echorl.net.addrs import tcp_endpoint

    addrs = list(host.addrs[:15])
    port = next((ep[1] for ep in map(tcp_endpoint, addrs) if ep is not None), None)
    if port is not None:
        addrs.append(f"/ip4/127.0.0.1/tcp/{port}/p2p/{host.peer_id}")
    return list(dict.fromkeys(addrs))


def _own_ips() -> set[str]:
    from echorl.net.addrs import interface_ips

    return {*interface_ips(4), *interface_ips(6), "127.0.0.1", "::1"}


def _placed_row(reachable: bool, seen_ip: str, bootstrap: str, seen: list[str], addrs: list[str]) -> Row:
    """The reachability row from the dial-back's answer: where this machine is from the learner."""
    import ipaddress

    from echorl.net.addrs import tcp_endpoint

    ours = _own_ips()
    learner_ip = (tcp_endpoint(bootstrap) or ("", 0))[0]
    seen_as = f"seen as {', '.join(seen)}" if seen else f"seen from {seen_ip or 'an unknown address'}"
    if learner_ip in ours or (learner_ip and ipaddress.ip_address(learner_ip).is_loopback):
        if reachable:
            return Row("reachability", "pass", f"same machine as the learner: it dialled us back at {seen_ip}")
        return Row("reachability", "warn", "same machine as the learner, yet it could not dial us back: a firewall?")
    if seen_ip in ours:
        where = "same network (LAN)" if ipaddress.ip_address(seen_ip).is_private else "a public address of ours"
        if reachable:
            return Row(
                "reachability",
                "pass",
                f"the learner dialled us back at {seen_ip}: reachable; {where}, no NAT between us",
            )
        return Row(
            "reachability",
            "warn",
            f"{where}, no NAT between us (the learner sees {seen_ip}, an address of this machine), but it could "
            f"not dial us back at {', '.join(addrs)}: a firewall blocks incoming connections; open the port",
        )
    if reachable:
        return Row("reachability", "pass", f"behind NAT ({seen_as}) with a forwarded port: the learner dialled us back")
    return Row(
        "reachability",
        "warn",
        f"the learner could not dial us back at {', '.join(addrs)}; {seen_as}, not an address of this "
        f"machine: behind NAT, {NOT_REACHABLE}",
    )


def _observed_row(seen: list[str], why: str) -> Row:
    """Without a dial-back (an older learner): judge by identify's observed address alone."""
    if not seen:
        return Row("reachability", "warn", f"{why}; the learner did not report how it sees us (same machine?)")
    if {a.split("/")[2] for a in seen} & _own_ips():
        return Row("reachability", "pass", f"{why}; seen as {', '.join(seen)}: an address of this machine")
    return Row(
        "reachability", "warn", f"{why}; seen as {', '.join(seen)}, not an address of this machine: {NOT_REACHABLE}"
    )


async def _join(host: Any, learner: str, run_id: str) -> None:
    """Join as a probe (``PROBE_ENGINE``): the learner serves weights to joined peers only, and
    counts a probe as no node (no lease, not in its status, ledger or metrics)."""
    import secrets

    from echorl.protocol import routes, wire
    from echorl.protocol.messages import PROBE_ENGINE, Capability, JoinAccepted, JoinRequest

    cap = Capability(
        engine=PROBE_ENGINE,
        device="none",
        memory_bytes=0,
        tokens_per_s=0.0,
        price_per_hour=0.0,
        reachable=False,
        listen_addrs=[],
    )
    join = JoinRequest(
        run_id=run_id,
        peer_id=host.peer_id,
        capability=cap,
        version=-1,
        timestamp=time.time(),
        nonce=secrets.token_bytes(16),
    )
    await host.request(learner, routes.JOIN, wire.sign(join, host.identity), expect=JoinAccepted, timeout=15.0)


async def _download_rows(host: Any, learner: str, run_id: str, seconds: float) -> list[Row]:
    from echorl.net.host import PeerUnavailable, RemoteError
    from echorl.protocol import routes
    from echorl.protocol.messages import CatchUp, CatchUpRequest, Chunk, ChunkRequest

    try:
        await _join(host, learner, run_id)
    except (PeerUnavailable, RemoteError) as exc:
        return [Row("download", "fail", f"the learner refused a join, so it serves no weights: {exc}")]
    try:
        reply = await host.request(
            learner, routes.CATCHUP, CatchUpRequest(run_id=run_id, have_version=-1), expect=CatchUp, timeout=15.0
        )
    except (PeerUnavailable, RemoteError) as exc:
        return [Row("download", "fail", f"no manifest: {exc}")]
    if not reply.manifests:
        return [Row("download", "warn", "the learner has published nothing yet")]
    manifest = reply.manifests[0]  # the newest full snapshot: what a new node downloads first
    got, t0 = 0, time.perf_counter()
    with trio.move_on_after(seconds):
        for ref in manifest.chunks:
            try:
                chunk = await host.request(learner, routes.CHUNK, ChunkRequest(digest=ref.digest), expect=Chunk)
            except (PeerUnavailable, RemoteError) as exc:
                return [Row("download", "fail", f"chunk refused or lost: {exc}")]
            if not await trio.to_thread.run_sync(_digest_ok, chunk.data, ref.digest):
                return [Row("download", "fail", "a chunk did not match its signed digest")]
            got += len(chunk.data)
    elapsed = time.perf_counter() - t0
    mbps = got * 8 / elapsed / 1e6 if elapsed > 0 else 0.0
    per_version = manifest.payload_bytes * 8 / (mbps * 1e6) if mbps > 0 else float("inf")
    rows = [
        Row(
            "download",
            "pass" if mbps >= 10 else "warn",
            f"{mbps:.1f} Mbit/s from the learner ({got / 1e6:.1f} MB verified); a full version of "
            f"{manifest.payload_bytes / 1e6:.1f} MB takes ~{per_version:.0f} s directly",
        )
    ]
    from echorl.protocol.limits import MAX_CLOCK_SKEW_S

    skew = max(m.created_at for m in reply.manifests) - time.time()
    rows.append(
        Row(
            "clock",
            "fail" if skew > MAX_CLOCK_SKEW_S else "pass",
            f"this clock is {skew:.0f} s behind the learner's (joins would be refused)"
            if skew > MAX_CLOCK_SKEW_S
            else "not behind the learner's (its newest manifest is not from our future)",
        )
    )
    return rows


def _digest_ok(data: bytes, digest: bytes) -> bool:
    import hashlib

    return hashlib.sha256(data).digest() == digest


def _local_checks(args: argparse.Namespace) -> list[Row]:
    rows = []
    rows.append(_key_row(Path(args.key).expanduser()))
    key = Path(args.key).expanduser()
    where = key.parent if key.parent.exists() else Path.home()
    free = shutil.disk_usage(where).free
    rows.append(
        Row(
            "disk",
            "pass" if free >= 2 << 30 else "warn",
            f"{free / 2**30:.1f} GiB free under {where} (weights are kept in a state dir there)",
        )
    )
    rows.append(_torch_row())
    return rows


def _key_row(key: Path) -> Row:
    """The key file as ``echorl node`` will load it (``protocol/identity.py``: the same rules)."""
    from echorl.protocol.identity import KeyFileError, load_identity

    if not key.exists() and not key.is_symlink():
        return Row("key", "warn", f"{key} does not exist yet: `echorl node` creates it (mode 0600)")
    try:
        identity = load_identity(key)
    except KeyFileError as exc:
        return Row("key", "fail", str(exc))
    return Row("key", "pass", f"{key} (mode 600), peer {identity.peer_id}")


def _torch_row() -> Row:
    try:
        import torch
    except Exception as exc:
        return Row("torch", "fail", f"torch does not import: {exc}")
    if torch.cuda.is_available():
        return Row("torch", "pass", f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    return Row("torch", "warn", f"torch {torch.__version__}, CPU only (works, slowly; --device cuda needs a GPU)")
