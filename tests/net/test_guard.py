"""Strikes and bans agree on what one host is (issue 24, finding 7): a ban covers an IPv6
address's /64, so the exemption for an admitted peer sharing the struck peer's address compares
/64s too; an admitted peer in the struck peer's /64 spares it (it would be locked out by the
ban), one elsewhere does not."""

from __future__ import annotations

from types import SimpleNamespace

import trio

from echorl.net.guard import ConnectionGuard
from echorl.net.host import HostConfig
from echorl.net.hostkey import same_host
from echorl.net.serving import RouteServer
from echorl.protocol.messages import Status, StatusRequest


def test_same_host_is_what_a_ban_covers() -> None:
    assert same_host("2001:db8:1:2::bad", "2001:db8:1:2:ffff::1")  # one /64
    assert not same_host("2001:db8:1:2::bad", "2001:db8:1:3::bad")
    assert same_host("198.18.0.1", "::ffff:198.18.0.1")
    assert not same_host("198.18.0.1", "198.18.0.2")
    assert not same_host(None, None) and not same_host("", "")


class _Host:
    """The surface ``RouteServer._strike`` uses: addresses, connected peers, the guard."""

    def __init__(self, ips: dict[str, str]) -> None:
        self.config = HostConfig()
        self.guard = ConnectionGuard()
        self.ips = ips
        self.libp2p = SimpleNamespace(set_stream_handler=lambda *_: None)
        self.gone: list[str] = []

    def remote_ip(self, peer: str) -> str | None:
        return self.ips.get(peer)

    def connected_peers(self) -> list[str]:
        return list(self.ips)

    async def disconnect(self, peer: str) -> None:
        self.gone.append(peer)


async def _status(msg, ctx):
    return Status(run_id="r", learner={}, peers=[])


def _strike(bad_ip: str, good_ip: str) -> _Host:
    host = _Host({"bad": bad_ip, "good": good_ip})
    server = RouteServer(host)  # type: ignore[arg-type]
    server.route("/echorl/test/1", _status, request=StatusRequest, admit=lambda peer: peer == "good")
    trio.run(server._strike, "bad")
    assert host.gone == ["bad"]
    return host


def test_a_strike_spares_the_ipv6_64_an_admitted_peer_shares() -> None:
    host = _strike("2001:db8:1:2::bad", "2001:db8:1:2::600d")
    assert not host.guard.banned("2001:db8:1:2::600d") and not host.guard.banned("2001:db8:1:2::bad")


def test_a_strike_bans_the_64_when_no_admitted_peer_shares_it() -> None:
    host = _strike("2001:db8:1:2::bad", "2001:db8:9:9::600d")
    assert host.guard.banned("2001:db8:1:2::1") and not host.guard.banned("2001:db8:9:9::600d")
