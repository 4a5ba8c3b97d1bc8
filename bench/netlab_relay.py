"""Experiment: py-libp2p 0.8.1 circuit relay v2 across the namespace lab (tests/netlab.py).

    python bench/netlab_relay.py --json

A relay (public namespace, hop enabled), a destination behind the lab's NAT that reserves a
slot on it, and a public source that dials ``<relay>/p2p-circuit/p2p/<dst>`` and echoes a
message over the relayed connection. Prints one JSON line: reserved, relayed_ok, seconds (dial +
echo). echorl does not use relays: a NAT'd node dials out and is a broadcast leaf; this records
whether the library's relay works, for a future NAT-to-NAT path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2 import PROTOCOL_ID, CircuitV2Protocol, CircuitV2Transport
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.tools.anyio_service import background_trio_service

from echorl.net.host import HostConfig, open_host
from echorl.protocol.identity import Identity

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit
from netlab import ENV, _lab_module

ECHO = TProtocol("/echo/1")


def out(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


async def role_main(role: str, argv: list[str]) -> None:
    """One peer of the experiment: ``relay``; ``dst ADDR`` (reserve on the relay, serve echo);
    ``src ADDR DST_ID`` (dial through the relay, echo once, print the result)."""
    async with open_host(Identity.generate(), HostConfig(listen="/ip4/0.0.0.0/tcp/0")) as host:
        proto = CircuitV2Protocol(host.libp2p, allow_hop=role == "relay")
        async with background_trio_service(proto):
            await proto.event_started.wait()
            if role == "relay":
                out(event="ready", addr=host.addrs[0])
                await trio.sleep(120)
                return
            relay_id = ID.from_base58(await host.connect(argv[0]))
            transport = CircuitV2Transport(host.libp2p, proto, RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT))
            if role == "dst":
                await _serve_via_relay(host, transport, relay_id)
            else:
                await _dial_via_relay(host, transport, argv[0], argv[1])


async def _serve_via_relay(host: object, transport: CircuitV2Transport, relay_id: ID) -> None:
    async def echo(stream: object) -> None:
        await stream.write(await stream.read(100))  # type: ignore[attr-defined]
        await stream.close()  # type: ignore[attr-defined]

    host.libp2p.set_stream_handler(ECHO, echo)  # type: ignore[attr-defined]
    async with trio.open_nursery() as nursery:
        stream = await host.libp2p.new_stream(relay_id, [PROTOCOL_ID])  # type: ignore[attr-defined]
        reserved = await transport.reserve(stream, relay_id, nursery)
        out(event="ready", reserved=reserved, peer_id=host.peer_id)  # type: ignore[attr-defined]
        await trio.sleep(90)
        nursery.cancel_scope.cancel()


async def _dial_via_relay(host: object, transport: CircuitV2Transport, relay_addr: str, dst: str) -> None:
    message = b"hello through the relay"
    t = time.perf_counter()
    try:
        with trio.fail_after(30):
            await transport.dial(multiaddr.Multiaddr(f"{relay_addr}/p2p-circuit/p2p/{dst}"))
            stream = await host.libp2p.new_stream(ID.from_base58(dst), [ECHO])  # type: ignore[attr-defined]
            await stream.write(message)
            reply = await stream.read(100)
        out(event="result", ok=reply == message, seconds=round(time.perf_counter() - t, 3))
    except Exception as exc:
        out(event="result", ok=False, error=f"{type(exc).__name__}: {str(exc)[:300]}")


def _line(proc: subprocess.Popen) -> dict | None:
    for text in proc.stdout:  # type: ignore[union-attr]
        try:
            return json.loads(text)
        except ValueError:
            continue
    return None


def experiment() -> dict:
    Lab, unavailable = _lab_module()
    why = unavailable()
    if why:
        sys.exit(f"bench/netlab_relay.py: network lab unavailable: {why}")
    me = [sys.executable, str(Path(__file__).resolve()), "--role"]
    with Lab() as lab:
        relay, src, dst = lab.add_peer("relay"), lab.add_peer("src"), lab.add_peer("dst", nat=True)
        r = subprocess.Popen(relay.cmd(*me, "relay"), stdout=subprocess.PIPE, text=True, env=ENV)
        relay.procs.append(r)
        relay_addr = (_line(r) or {})["addr"]
        d = subprocess.Popen(dst.cmd(*me, "dst", relay_addr), stdout=subprocess.PIPE, text=True, env=ENV)
        dst.procs.append(d)
        ready = _line(d) or {}
        res = subprocess.run(
            src.cmd(*me, "src", relay_addr, ready.get("peer_id", "")),
            capture_output=True,
            text=True,
            env=ENV,
            timeout=120,
        )
        result = json.loads(res.stdout.strip().splitlines()[-1]) if res.stdout.strip() else {"ok": False}
    return {
        "reserved": bool(ready.get("reserved")),
        "relayed_ok": bool(result.get("ok")),
        "seconds": result.get("seconds"),
        "error": result.get("error"),
    }


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--role":
        trio.run(role_main, sys.argv[2], sys.argv[3:])
    else:
        emit(experiment(), "--json" in sys.argv)
