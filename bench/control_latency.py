"""Control-message latency over the real echorl host layer vs raw trio TCP on loopback.

    python bench/control_latency.py --requests 400 --json

A server process (this script with ``--serve``, started with subprocess) runs one echorl
``Host`` (libp2p TCP + Noise + yamux, ``open_host``) that routes ``/echorl/lease/1`` to a
handler answering every ``LeaseRequest`` with a fixed ``Lease`` of 8 prompts, and, in the
same trio run, a raw ``trio.serve_tcp`` server that answers a 4-byte-length-prefixed frame with
the length-prefixed ``wire.encode`` bytes of that same ``Lease``. The client process measures:

* ``connect_ms``: ``Host.connect`` of a fresh client host (dial + Noise + yamux), median of
  ``--fresh`` fresh client hosts;
* ``first_request_new_stream_ms``: the first ``Host.request`` right after connect (opens a new
  stream, multistream negotiation, then LeaseRequest→Lease), median over the same fresh hosts;
* ``reused_p50_ms`` / ``reused_p99_ms``: ``--requests`` LeaseRequest→Lease round trips on the
  pooled (reused) stream;
* baseline, same run, same server process: ``raw_tcp_p50_ms`` / ``raw_tcp_p99_ms``, the same
  request/reply bytes over one ``trio.open_tcp_stream`` connection, length-prefixed, no
  decode (transport floor). The two loops are interleaved request by request so that both see the
  same background load; ``loadavg`` (1/5/15 min) is recorded because the 2 cores are shared.

Prints one JSON line with ``--json`` (a readable table otherwise). topology = "two_processes".
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import emit

from echorl.net.host import open_host
from echorl.protocol import wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Lease, LeasePrompt, LeaseRequest, SamplingSpec

PROTO = "/echorl/lease/1"


def the_lease() -> Lease:
    return Lease(
        lease_id="L1",
        run_id="r",
        prompts=[LeasePrompt(prompt_id=f"p{i}", text=f"{10 + i}+{34 + i}=") for i in range(8)],
        group_size=8,
        sampling=SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=5, stop=[]),
        min_version=0,
        deadline_s=30.0,
    )


def the_request() -> LeaseRequest:
    return LeaseRequest(run_id="r", version=0, max_prompts=8)


async def _read_exact(stream: trio.abc.ReceiveStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


async def _read_frame(stream: trio.abc.ReceiveStream) -> bytes:
    (n,) = struct.unpack(">I", await _read_exact(stream, 4))
    return await _read_exact(stream, n)


# --- server process --------------------------------------------------------------------------
async def serve() -> None:
    lease = the_lease()
    reply = wire.encode(lease)
    reply_frame = struct.pack(">I", len(reply)) + reply

    async def on_lease(msg, ctx):
        return lease

    async def raw_handler(stream: trio.SocketStream) -> None:
        try:
            while True:
                await _read_frame(stream)
                await stream.send_all(reply_frame)
        except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async with open_host(Identity.generate()) as host:
        host.route(PROTO, on_lease, request=LeaseRequest, rate=None)
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(functools.partial(trio.serve_tcp, raw_handler, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            print(json.dumps({"addr": host.addrs[0], "peer_id": host.peer_id, "tcp_port": port}), flush=True)
            # run until the parent closes our stdin
            await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
            nursery.cancel_scope.cancel()


# --- client ----------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def client(info: dict, n: int, fresh: int) -> dict:
    req = the_request()
    req_bytes = wire.encode(req)
    req_frame = struct.pack(">I", len(req_bytes)) + req_bytes
    connects, firsts = [], []
    for _ in range(fresh):  # fresh client hosts: cold connect + first request on a new stream
        async with open_host(Identity.generate()) as b:
            t = time.perf_counter()
            await b.connect(info["addr"])
            connects.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = await b.request(info["peer_id"], PROTO, req, expect=Lease)
            firsts.append(time.perf_counter() - t)
            assert isinstance(got, Lease) and len(got.prompts) == 8
    async with open_host(Identity.generate()) as b:
        await b.connect(info["addr"])
        raw = await trio.open_tcp_stream("127.0.0.1", info["tcp_port"])
        async with raw:
            for _ in range(20):  # warm both paths
                await b.request(info["peer_id"], PROTO, req, expect=Lease)
                await raw.send_all(req_frame)
                await _read_frame(raw)
            host_lat, raw_lat = [], []
            for i in range(n):
                order = (0, 1) if i % 2 == 0 else (1, 0)  # interleave, alternating who goes first
                for which in order:
                    if which == 0:
                        t = time.perf_counter()
                        await b.request(info["peer_id"], PROTO, req, expect=Lease)
                        host_lat.append(time.perf_counter() - t)
                    else:
                        t = time.perf_counter()
                        await raw.send_all(req_frame)
                        body = await _read_frame(raw)
                        raw_lat.append(time.perf_counter() - t)
            assert len(body) == len(wire.encode(the_lease()))
    ms = 1e3
    out = {
        "bench": "control_latency",
        "topology": "two_processes",
        "requests": n,
        "fresh_hosts": fresh,
        "request_bytes": len(req_bytes),
        "reply_bytes": len(body),
        "connect_ms": round(statistics.median(connects) * ms, 3),
        "first_request_new_stream_ms": round(statistics.median(firsts) * ms, 3),
        "connect_ms_all": [round(x * ms, 2) for x in connects],
        "first_request_new_stream_ms_all": [round(x * ms, 2) for x in firsts],
        "reused_p50_ms": round(pct(host_lat, 0.50) * ms, 3),
        "reused_p99_ms": round(pct(host_lat, 0.99) * ms, 3),
        "raw_tcp_p50_ms": round(pct(raw_lat, 0.50) * ms, 3),
        "raw_tcp_p99_ms": round(pct(raw_lat, 0.99) * ms, 3),
    }
    out["reused_over_raw_p50"] = round(out["reused_p50_ms"] / max(1e-9, out["raw_tcp_p50_ms"]), 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--fresh", type=int, default=3, help="fresh client hosts for connect / first-request")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        trio.run(serve)
        return
    load_before = os.getloadavg()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit("server process did not start")
        info = json.loads(line)
        out = trio.run(client, info, args.requests, args.fresh)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    out["loadavg_before"] = [round(x, 2) for x in load_before]
    out["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    out["cpu_count"] = os.cpu_count()
    emit(out, args.json)


if __name__ == "__main__":
    main()
