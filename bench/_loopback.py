"""Many hosts on one machine: each bench peer on its own loopback address (127.0.0.0/8).

py-libp2p dials from the kernel's choice of source address (127.0.0.1 on loopback), so without
this every bench peer would be one address to the learner. A peer listens on
``/ip4/<loopback(i)>/tcp/0`` and ``bind_dials`` makes its dials leave from that address too
(the TCP transport's ``dial_with_source``): the learner's per-address rules (joins, leases,
connections per address) then see it as its own host. Used by ``bench/swarm.py`` and
``bench/adversary.py``.
"""

from __future__ import annotations

from typing import Any

#: the first address handed out: 127.0.0.1 is the learner's and the honest nodes'
FIRST = 2
#: 127.0.0.0/8 holds 2**24 addresses; past its end peers fall back to the shared 127.0.0.1
LAST = 2**24 - 1


def loopback(i: int) -> str:
    """Peer ``i``'s own address in 127.0.0.0/8 (127.0.0.2 on; 127.0.0.1 is the learner's)."""
    i += FIRST
    return f"127.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}" if i < LAST else "127.0.0.1"


def listen_on(ip: str) -> str:
    """The multiaddr a host on ``ip`` listens on (any free port)."""
    return f"/ip4/{ip}/tcp/0"


def bind_dials(host: Any, ip: str) -> None:
    """Make ``host``'s TCP dials leave from ``ip`` (py-libp2p dials from the kernel's choice,
    127.0.0.1 on loopback): the learner then counts this peer as its own address."""
    for transport in host.libp2p.get_network().transport_manager.get_transports():
        with_source = getattr(transport, "dial_with_source", None)
        if callable(with_source):
            transport.dial = lambda maddr, _f=with_source: _f(maddr, (ip, 0))
