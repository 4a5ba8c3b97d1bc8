"""The dial-back check: is a peer reachable at an address it advertises?

``dial_back`` connects to the peer's advertised TCP addresses and returns the first that
answers libp2p's multistream-select header. A node behind NAT advertises addresses of its
private network, which fail; such a node must be a broadcast leaf (children dial their parents).
Only addresses on ``remote_ip`` (where the peer's authenticated connection comes from) are
dialed, so a join cannot make the learner connect to third parties; at most ``MAX_PROBES``, in
parallel, the first success ends the others. The learner keeps only the address that answered
(``learner/membership.py``): broadcast plans carry dial-back-verified addresses only.
"""

from __future__ import annotations

import trio

from echorl.net.addrs import tcp_endpoint

MULTISTREAM = b"/multistream/1.0.0\n"
MAX_ADDRS_READ = 16  # advertised addresses looked at
MAX_PROBES = 8  # ... of which at most this many (on the connection's IP) are dialed
MAX_ANSWER_BYTES = 256  # the multistream header comes first: more is not read


async def dial_back(addrs: list[str], remote_ip: str | None, timeout_s: float = 2.0) -> str | None:
    """The first of ``addrs`` on ``remote_ip`` that accepts a TCP connection from here and
    speaks libp2p, or None (see module doc)."""
    candidates = [(a, tcp_endpoint(a)) for a in addrs[:MAX_ADDRS_READ]]
    endpoints = [(a, e) for a, e in candidates if e is not None and e[0] == remote_ip][:MAX_PROBES]
    verified: str | None = None
    async with trio.open_nursery() as nursery:

        async def probe(addr: str, host: str, port: int) -> None:
            nonlocal verified
            if await speaks_libp2p(host, port, timeout_s) and verified is None:
                verified = addr
                nursery.cancel_scope.cancel()

        for addr, (host, port) in endpoints:
            nursery.start_soon(probe, addr, host, port)
    return verified


async def speaks_libp2p(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host:port`` answers the multistream-select header within ``timeout_s``."""
    got = b""
    with trio.move_on_after(timeout_s):
        try:
            stream = await trio.open_tcp_stream(host, port)
            async with stream:
                await stream.send_all(bytes([len(MULTISTREAM)]) + MULTISTREAM)
                while MULTISTREAM not in got and len(got) < MAX_ANSWER_BYTES:
                    chunk = await stream.receive_some(MAX_ANSWER_BYTES)
                    if not chunk:
                        break
                    got += chunk
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
    return MULTISTREAM in got
