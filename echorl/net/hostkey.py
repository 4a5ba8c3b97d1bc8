"""What one host counts as, for every per-address bound (connections, joins, newcomer turns, a
batch's share, bans): an IPv4 address, or an IPv6 address's /64.

Standard library only, so the learner's books (``learner/peers.py``, ``learner/roster.py``) and
what imports them load without the network stack.
"""

from __future__ import annotations

import ipaddress


def ip_key(ip: str | None) -> str:
    """What one host counts as: the IPv4 address, an IPv6 address's /64 ("" if unknown)."""
    if not ip:
        return ""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.ip_network(f"{addr}/64", strict=False))
    return str(addr)


def same_host(a: str | None, b: str | None) -> bool:
    """Whether two addresses count as one host (``ip_key``: the same IPv4 address, the same
    IPv6 /64): what a ban covers is what a strike's exemption compares."""
    key = ip_key(a)
    return bool(key) and key == ip_key(b)
