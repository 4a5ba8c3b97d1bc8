"""Experiment: does py-libp2p 0.8.1's DCUtR hole punching work across two NATs in the lab?

    python bench/netlab_dcutr.py --json [--nat reset|silent]

``--nat reset`` (default): the lab's NATs as they are, whose own kernel answers an unsolicited
SYN to their public address with a RST; ``--nat silent``: the NATs drop it instead, as most
home routers do (``Lab(nat_silent=True)``).

A relay (public namespace, circuit-relay-v2 hop), peer A behind NAT 0 (public side
198.18.0.254) and peer B behind NAT 1 (198.18.0.253); both NATs masquerade and drop new
inbound (tests/netlab.py). A and B reserve on the relay; A dials B through
``<relay>/p2p-circuit`` and echoes (relayed_ok). Then two tries at a direct A<->B path:

1. the library as designed: both run ``DCUtRProtocol`` (its auto-drive loop and an explicit
   ``initiate_hole_punch`` from A); direct_ok if A then echoes over a connection to B whose
   transport address is not a /p2p-circuit one;
2. plain TCP simultaneous open, outside libp2p: over a relayed stream A and B swap their
   NAT-public address (identify's observed IP) and a fresh port, then both connect() to each
   other from that port (SO_REUSEADDR/SO_REUSEPORT) until one connection carries an echo
   (manual_ok). This says whether hole punching through these NATs works at all, so a
   failure of (1) can be put on the library or on the NAT.

Prints one JSON line, with the NATs' conntrack TCP entries and the library's own DCUtR log
lines (full logs: the ``logs`` folder it names).
Hosts are plain ``libp2p.new_host`` ones (default connection limits), not echorl's
``open_host``, which allows one connection per peer and so could never add a direct one.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.secp256k1 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2 import PROTOCOL_ID, CircuitV2Protocol, CircuitV2Transport
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.tools.anyio_service import background_trio_service

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit
from netlab import ENV, _lab_module
from netlab_relay import _line, out

ECHO = TProtocol("/echo/1")
SWAP = TProtocol("/echorl-lab/swap/1")  # the manual try's address exchange, over the relay
MANUAL_PORT = {"a": 47001, "b": 47002}
DCUTR_S = 45.0  # the library's try: a 10 s unilateral dial, the exchange, 3 rounds of <= 5 s + 2 s
MANUAL_S = 10.0


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def _is_direct(conn: Any) -> bool:
    addrs = conn.get_transport_addresses()
    return bool(addrs) and all("/p2p-circuit" not in str(a) for a in addrs)


def _conn_addrs(host: Any, peer: ID) -> list[str]:
    return [str(a) for c in host.get_network().get_connections(peer) for a in c.get_transport_addresses()]


async def _echo_server(stream: Any) -> None:
    with trio.move_on_after(10):
        await stream.write(await stream.read(100))
    await stream.close()


async def role_main(role: str, argv: list[str]) -> None:
    """``relay IP``; ``b IP RELAY``: reserve, serve echo and the swap; ``a IP RELAY B_ID``: reserve,
    echo through the relay, then DCUtR, then the manual simultaneous open."""
    host = new_host(key_pair=create_new_key_pair(), listen_addrs=[multiaddr.Multiaddr(f"/ip4/{argv[0]}/tcp/0")])
    async with host.run(listen_addrs=[multiaddr.Multiaddr(f"/ip4/{argv[0]}/tcp/0")]):
        relay = CircuitV2Protocol(host, allow_hop=role == "relay")
        async with background_trio_service(relay):
            await relay.event_started.wait()
            addr = f"{host.get_addrs()[0]}"
            if role == "relay":
                out(event="ready", addr=addr)
                await trio.sleep(120)
                return
            relay_info = multiaddr.Multiaddr(argv[1])
            relay_id = ID.from_base58(relay_info.value_for_protocol("p2p"))
            await host.connect(info_from_p2p_addr(relay_info))
            transport = CircuitV2Transport(host, relay, RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT))
            dcutr = DCUtRProtocol(host)
            async with background_trio_service(dcutr), trio.open_nursery() as nursery:
                await dcutr.event_started.wait()
                stream = await host.new_stream(relay_id, [PROTOCOL_ID])
                reserved = await transport.reserve(stream, relay_id, nursery)
                await trio.sleep(1.0)  # identify's observed address arrives
                if role == "b":
                    host.set_stream_handler(ECHO, _echo_server)
                    host.set_stream_handler(SWAP, lambda s: _swap_responder(host, s))
                    out(event="ready", reserved=reserved, peer_id=str(host.get_id()))
                    await trio.sleep(90)
                else:
                    out(
                        event="result",
                        reserved=reserved,
                        **await _a_run(host, transport, dcutr, argv[1], ID.from_base58(argv[2])),
                    )
                nursery.cancel_scope.cancel()


async def _echo(host: Any, peer: ID, message: bytes) -> bool:
    with trio.fail_after(10):
        stream = await host.new_stream(peer, [ECHO])
        await stream.write(message)
        reply = await stream.read(100)
    return reply == message


async def _a_run(host: Any, transport: CircuitV2Transport, dcutr: DCUtRProtocol, relay_addr: str, b: ID) -> dict:
    res: dict[str, Any] = {
        "relayed_ok": False,
        "dcutr_attempted": False,
        "direct_ok": False,
        "manual_ok": False,
        "error": None,
        "manual_error": None,
    }
    t = time.perf_counter()
    try:
        with trio.fail_after(30):
            await transport.dial(multiaddr.Multiaddr(f"{relay_addr}/p2p-circuit/p2p/{b}"))
            res["relayed_ok"] = await _echo(host, b, b"hello through the relay")
    except Exception as exc:
        res["error"] = _err(exc)
        return res
    res["observed"] = [str(a) for a in host._observed_addr_manager.addrs(min_observers=1)]
    res["advertised"] = [str(multiaddr.Multiaddr(x)) for x in await dcutr._get_observed_addrs()]
    res["dcutr_attempted"] = True
    try:
        with trio.fail_after(DCUTR_S):
            res["dcutr_returned"] = await dcutr.initiate_hole_punch(b)
        res["conns_after_dcutr"] = _conn_addrs(host, b)
        res["direct_ok"] = await _echo_over_direct(host, b)
    except Exception as exc:
        res["error"] = _err(exc)
    res["seconds"] = round(time.perf_counter() - t, 3)
    try:
        res["manual_ok"] = await _manual_initiator(host, b)
    except Exception as exc:
        res["manual_error"] = _err(exc)
    return res


async def _echo_over_direct(host: Any, b: ID) -> bool:
    """Close the relayed connections to ``b``; if a direct one is left, echo over it."""
    conns = host.get_network().get_connections(b)
    if not any(_is_direct(c) for c in conns):
        return False
    for c in conns:
        if not _is_direct(c):
            await c.close()
    return await _echo(host, b, b"hello direct")


# --- the manual try: TCP simultaneous open from both NATs ---------------------------------------
def _public_ip(host: Any) -> str:
    for a in host._observed_addr_manager.addrs(min_observers=1):
        if "/p2p-circuit" not in str(a):
            return a.value_for_protocol("ip4")
    raise RuntimeError("no observed (NAT-public) address from identify")


async def _manual_initiator(host: Any, b: ID) -> bool:
    mine = {"ip": _public_ip(host), "port": MANUAL_PORT["a"]}
    with trio.fail_after(10):
        stream = await host.new_stream(b, [SWAP])
        await stream.write(json.dumps(mine).encode())
        theirs = json.loads((await stream.read(200)).decode())
    return await _simultaneous_open(MANUAL_PORT["a"], theirs["ip"], int(theirs["port"]))


async def _swap_responder(host: Any, stream: Any) -> None:
    try:
        with trio.fail_after(10):
            theirs = json.loads((await stream.read(200)).decode())
            await stream.write(json.dumps({"ip": _public_ip(host), "port": MANUAL_PORT["b"]}).encode())
        ok = await _simultaneous_open(MANUAL_PORT["b"], str(theirs["ip"]), int(theirs["port"]))
        out(event="manual", ok=ok)
    except Exception as exc:
        out(event="manual", ok=False, error=_err(exc))


async def _simultaneous_open(port: int, ip: str, their_port: int) -> bool:
    """connect() from ``port`` to ``ip:their_port`` until one attempt connects; then a byte each way."""
    deadline = trio.current_time() + MANUAL_S
    while trio.current_time() < deadline:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            await sock.bind(("0.0.0.0", port))
            with trio.move_on_after(3):
                await sock.connect((ip, their_port))
                await sock.send(b"x")
                return await sock.recv(1) == b"x"
        except OSError:
            await trio.sleep(0.2)
        finally:
            sock.close()
    return False


# --- the driver -----------------------------------------------------------------------------------
def _outcomes(log: Path) -> list[str]:
    """The library's own words on each DCUtR session (its INFO/WARNING lines), first few."""
    keys = ("Unilateral", "Successfully established", "Failed to establish", "Maximum hole punch", "Timeout in DCUtR")
    text = log.read_text(errors="replace").splitlines()
    return [line.strip()[-140:] for line in text if any(k in line for k in keys)][:6]


def _nat_view(lab: Any) -> dict:
    """Per NAT: the forward chain's drop count is not kept, so report the conntrack TCP entries."""
    seen = {}
    for index, ns in lab._nat_ns.items():
        ct = subprocess.run(
            ["ip", "netns", "exec", ns, "cat", "/proc/net/nf_conntrack"], capture_output=True, text=True, timeout=10
        )
        rows = [
            " ".join(w for w in line.split() if w.startswith(("src=", "dst=", "sport=", "dport=")) or w.isupper())
            for line in ct.stdout.splitlines()
            if " tcp " in line
        ]
        seen[f"nat{index}"] = rows[:12] if ct.returncode == 0 else f"conntrack unreadable: {ct.stderr.strip()[:80]}"
    return seen


def experiment(nat_mode: str = "reset") -> dict:
    Lab, unavailable = _lab_module()
    why = unavailable()
    if why:
        sys.exit(f"bench/netlab_dcutr.py: network lab unavailable: {why}")
    me = [sys.executable, str(Path(__file__).resolve()), "--role"]
    logs = Path(tempfile.mkdtemp(prefix="netlab_dcutr-"))
    # the library's session outcomes on stderr (and its own log file, kept with ours)
    env = {
        role: {**ENV, "LIBP2P_DEBUG": "relay.circuit_v2.dcutr:INFO", "LIBP2P_DEBUG_FILE": str(logs / f"{role}.libp2p")}
        for role in ("a", "b")
    }
    t = time.perf_counter()
    with Lab(nat_silent=nat_mode == "silent") as lab:
        relay, a, b = lab.add_peer("relay"), lab.add_peer("a", nat=True), lab.add_peer("b", nat=True, nat_index=1)
        r = subprocess.Popen(relay.cmd(*me, "relay", relay.ip), stdout=subprocess.PIPE, text=True, env=ENV)
        relay.procs.append(r)
        relay_addr = (_line(r) or {})["addr"]
        bp = subprocess.Popen(
            b.cmd(*me, "b", b.ip, relay_addr),
            stdout=subprocess.PIPE,
            text=True,
            env=env["b"],
            stderr=(logs / "b.log").open("w"),
        )
        b.procs.append(bp)
        ready = _line(bp) or {}
        res = subprocess.run(
            a.cmd(*me, "a", a.ip, relay_addr, ready.get("peer_id", "")),
            capture_output=True,
            text=True,
            env=env["a"],
            timeout=120,
        )
        (logs / "a.log").write_text(res.stderr)
        lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
        result = (
            lines[-1]
            if lines
            else {"error": f"peer A printed nothing (rc {res.returncode}): {res.stderr.strip()[-300:]}"}
        )
        nats = _nat_view(lab)
        lab.stop_processes(grace_s=5)
        b_manual = _line(bp) or {}
    result.pop("event", None)
    return {
        "nat": nat_mode,
        "relayed_ok": bool(result.get("relayed_ok")),
        "dcutr_attempted": bool(result.get("dcutr_attempted")),
        "direct_ok": bool(result.get("direct_ok")),
        "manual_ok": bool(result.get("manual_ok")),
        "seconds": result.get("seconds"),
        "error": result.get("error"),
        "manual_error": result.get("manual_error") or b_manual.get("error"),
        "b_reserved": bool(ready.get("reserved")),
        "detail": {
            k: v
            for k, v in result.items()
            if k not in {"relayed_ok", "dcutr_attempted", "direct_ok", "manual_ok", "seconds", "error", "manual_error"}
        },
        "library_said": {"a": _outcomes(logs / "a.log"), "b": _outcomes(logs / "b.log")},
        "nats": nats,
        "logs": str(logs),
        "total_seconds": round(time.perf_counter() - t, 1),
    }


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        trio.run(role_main, sys.argv[2], sys.argv[3:])
    else:
        mode = sys.argv[sys.argv.index("--nat") + 1] if "--nat" in sys.argv else "reset"
        if mode not in ("reset", "silent"):
            sys.exit("--nat is reset (the lab's NAT: its kernel answers unsolicited SYNs with RST) or silent")
        emit(experiment(mode), "--json" in sys.argv)
