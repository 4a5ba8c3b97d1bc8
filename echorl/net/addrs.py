"""Addresses a user types and addresses a peer advertises, and why a dial failed.

A volunteer's first contact with echorl is a multiaddr pasted from someone else's terminal, so
every address is checked where it enters (``parse_peer_addr``, ``parse_listen``,
``parse_announce``): a bad one is one line that says what is wrong and shows an example, before
anything slow (a model load) happens. ``advertised_addrs`` is what a peer tells others to dial:
``--announce`` addresses first, then the real interface addresses of a wildcard listen (never
``0.0.0.0``; loopback only when nothing else exists or the peer listens on loopback only).
``dial_reason`` turns py-libp2p's nested dial errors ("no addresses established a successful
connection") into the cause a user can act on: refused, timed out, unreachable, wrong peer id.
"""

from __future__ import annotations

import errno
import ipaddress
import socket

import multiaddr
import trio
from libp2p.peer.id import ID

EXAMPLE = "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooW…"
LISTEN_EXAMPLE = "/ip4/0.0.0.0/tcp/4001"
_IP = ("ip4", "ip6")
_HOSTS = ("ip4", "ip6", "dns", "dns4", "dns6")


class AddressError(ValueError):
    """A user-supplied address is not usable; the message is one line, with an example."""


def _parts(addr: multiaddr.Multiaddr) -> list[tuple[str, str]]:
    return [(p.name, addr.value_for_protocol(p.code) or "") for p in addr.protocols()]


def _multiaddr(text: str, what: str, example: str) -> multiaddr.Multiaddr:
    if not isinstance(text, str) or not text.strip():
        raise AddressError(f"{what} is empty; expected a multiaddr, e.g. {example}")
    try:
        return multiaddr.Multiaddr(text.strip())
    except Exception as exc:
        raise AddressError(
            f"{what} {text!r} is not a multiaddr ({type(exc).__name__}); expected e.g. {example}"
        ) from None


def parse_peer_addr(text: str, what: str = "--bootstrap") -> str:
    """``/ip4|ip6|dns*/HOST/tcp/PORT/p2p/PEER_ID``, checked; returns it normalised."""
    addr = _multiaddr(text, what, EXAMPLE)
    parts = _parts(addr)
    names = [n for n, _ in parts]
    if "p2p" not in names:
        raise AddressError(
            f"{what} {text!r} has no /p2p/<peer id>: the learner prints its full address "
            f"(e.g. {EXAMPLE}); copy all of it"
        )
    if len(parts) != 3 or names[0] not in _HOSTS or names[1] != "tcp" or names[2] != "p2p":
        raise AddressError(f"{what} {text!r} is not /ip4/<host>/tcp/<port>/p2p/<peer id> (e.g. {EXAMPLE})")
    host, port, peer = (v for _, v in parts)
    if names[0] in _IP and ipaddress.ip_address(host).is_unspecified:
        raise AddressError(
            f"{what} {text!r} names the wildcard {host}, which no peer can dial; "
            f"use the learner's real address (e.g. {EXAMPLE})"
        )
    if not 0 < int(port) < 65536:
        raise AddressError(f"{what} {text!r}: port {port} cannot be dialed (e.g. {EXAMPLE})")
    try:
        ID.from_base58(peer)
    except Exception:
        raise AddressError(f"{what} {text!r}: {peer!r} is not a peer id (e.g. {EXAMPLE})") from None
    return str(addr)


def parse_listen(text: str, what: str = "--listen") -> str:
    """``/ip4|ip6/IP/tcp/PORT`` (port 0: any free port)."""
    addr = _multiaddr(text, what, LISTEN_EXAMPLE)
    names = [n for n, _ in _parts(addr)]
    if names != ["ip4", "tcp"] and names != ["ip6", "tcp"]:
        raise AddressError(
            f"{what} {text!r} must be /ip4/<local ip>/tcp/<port> (e.g. {LISTEN_EXAMPLE}, "
            "or /ip4/127.0.0.1/tcp/0 for this machine only)"
        )
    return str(addr)


def parse_announce(text: str, what: str = "--announce") -> str:
    """A public ``/ip4|ip6|dns*/HOST/tcp/PORT`` address (a ``/p2p/`` suffix is dropped)."""
    addr = _multiaddr(text, what, "/ip4/203.0.113.7/tcp/4001")
    parts = _parts(addr)
    if parts and parts[-1][0] == "p2p":
        parts = parts[:-1]
    if len(parts) != 2 or parts[0][0] not in _HOSTS or parts[1][0] != "tcp":
        raise AddressError(f"{what} {text!r} must be /ip4/<public ip>/tcp/<port> or /dns4/<name>/tcp/<port>")
    if parts[0][0] in _IP and ipaddress.ip_address(parts[0][1]).is_unspecified:
        raise AddressError(f"{what} {text!r} is a wildcard; announce the address others dial")
    if not 0 < int(parts[1][1]) < 65536:
        raise AddressError(f"{what} {text!r}: port {parts[1][1]} cannot be dialed")
    return "".join(f"/{n}/{v}" for n, v in parts)


def checked_listen(listen: str, announce: list[str]) -> tuple[str, list[str]]:
    """A peer's ``--listen`` and ``--announce`` addresses parsed, and the listen address probed
    (:func:`port_taken`), so a bad one is one line (``AddressError``) before anything starts."""
    listen = parse_listen(listen)
    announced = [parse_announce(a) for a in announce]
    taken = port_taken(listen)
    if taken:
        raise AddressError(taken)
    return listen, announced


def port_taken(listen: str) -> str | None:
    """Why ``listen`` cannot be bound, or None: its fixed port is taken, or its address is not
    this machine's (port 0: any free port, so only the address is probed). A probe bind with
    SO_REUSEADDR, as py-libp2p's listener sets it, so a TIME_WAIT socket is no conflict."""
    names = dict(_parts(multiaddr.Multiaddr(listen)))
    port = int(names.get("tcp", "0"))
    family, host = (socket.AF_INET6, names["ip6"]) if "ip6" in names else (socket.AF_INET, names.get("ip4", ""))
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is already in use (another learner or program listens there)"
            where = f"{host}:{port}" if port else host
            return f"cannot listen on {where}: {exc.strerror or exc}"
    return None


def interface_ips(version: int = 4) -> list[str]:
    """This machine's addresses of one IP version, non-loopback first (link-local skipped)."""
    from multiaddr.utils import get_network_addrs

    try:
        ips = [ip for ip in get_network_addrs(version) or [] if not ipaddress.ip_address(ip).is_link_local]
    except Exception:
        ips = []
    return sorted(dict.fromkeys(ips), key=lambda ip: ipaddress.ip_address(ip).is_loopback)


def advertised_addrs(bound: list[str], announce: list[str] | tuple[str, ...], peer_id: str) -> list[str]:
    """What others should dial, each with ``/p2p/<peer_id>``: the announce addresses, then each
    bound address with a wildcard replaced by the interface addresses (loopback last, and only
    when the peer listens on loopback alone or no other interface exists)."""
    out: list[str] = [a if "/p2p/" in a else f"{a}/p2p/{peer_id}" for a in announce]
    for text in bound:
        base = text.split("/p2p/")[0]
        parts = _parts(multiaddr.Multiaddr(base))
        if len(parts) >= 2 and parts[0][0] in _IP and ipaddress.ip_address(parts[0][1]).is_unspecified:
            ips = interface_ips(4 if parts[0][0] == "ip4" else 6)
            public = [ip for ip in ips if not ipaddress.ip_address(ip).is_loopback]
            rest = "".join(f"/{n}/{v}" for n, v in parts[1:])
            out += [f"/{parts[0][0]}/{ip}{rest}/p2p/{peer_id}" for ip in (public or ips)]
        else:
            out.append(f"{base}/p2p/{peer_id}")
    return list(dict.fromkeys(out))


def tcp_endpoint(addr: str) -> tuple[str, int] | None:
    """(ip, port) of an ``/ip4|ip6/IP/tcp/PORT[/p2p/…]`` address; None for anything else."""
    try:
        parts = _parts(multiaddr.Multiaddr(addr.split("/p2p/")[0]))
    except Exception:
        return None
    if len(parts) != 2 or parts[0][0] not in _IP or parts[1][0] != "tcp":
        return None
    ip, port = parts[0][1], int(parts[1][1])
    if ipaddress.ip_address(ip).is_unspecified or not 0 < port < 65536:
        return None
    return ip, port


def _walk(exc: BaseException) -> list[BaseException]:
    """Every exception nested in py-libp2p's dial error (causes, contexts, MultiError lists)."""
    out: list[BaseException] = []
    todo = [exc]
    while todo and len(out) < 64:
        e = todo.pop()
        if e is None or any(e is seen for seen in out):
            continue
        out.append(e)
        todo += [e.__cause__, e.__context__]
        todo += list(getattr(e, "errors", None) or []) + list(getattr(e, "exceptions", None) or [])
    return [e for e in out if e is not None]


def dial_reason(exc: BaseException) -> str:
    """The cause of a failed dial, in words a user can act on."""
    found = _walk(exc)
    codes = {getattr(e, "errno", None) for e in found}
    text = " | ".join(str(e).lower() for e in found)
    if (
        isinstance(exc, trio.TooSlowError)
        or any(isinstance(e, (trio.TooSlowError, TimeoutError)) for e in found)
        or errno.ETIMEDOUT in codes
        or "timed out" in text
        or "timeout" in text
    ):
        return "timed out: nothing answered (wrong address, a firewall, or a peer behind NAT)"
    if errno.ECONNREFUSED in codes or any(isinstance(e, ConnectionRefusedError) for e in found) or "refused" in text:
        return "connection refused: nothing listens on that port (is the learner running? right port?)"
    if codes & {errno.EHOSTUNREACH, errno.ENETUNREACH} or "unreachable" in text:
        return "no route to that host (wrong address, or this machine is offline)"
    if any(type(e).__name__ == "PeerIDMismatchesPubkey" for e in found) or "peer id does not correspond" in text:
        return "the peer at that address is not the peer id in the address (wrong or old /p2p/ id?)"
    if "upgrade security" in text or "handshake" in text:
        # the peer closed or timed out the Noise handshake: a full or overloaded peer, not a wrong id
        return "the peer closed the handshake (full or overloaded? retry later)"
    if "fail to open connection" in text:
        return "connection refused: nothing listens on that port (is the learner running? right port?)"
    inner = found[-1] if found else exc
    return f"{type(inner).__name__}: {inner}"
