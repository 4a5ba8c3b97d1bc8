"""The learner fits a plan's member list into one announcement frame (``broadcast/members.py``)."""

from __future__ import annotations

from echorl.broadcast.members import fit_addrs, member_bytes
from echorl.protocol.identity import Identity
from echorl.protocol.messages import PlanMember

IDS = [Identity.generate().peer_id for _ in range(4)]
ADDRS = [f"/ip4/198.18.0.{i}/tcp/4001" for i in range(1, 4)]  # 22 bytes each


def _members(n: int) -> list[PlanMember]:
    return [PlanMember(peer_id=IDS[i % 4], reachable=True, addrs=list(ADDRS)) for i in range(n)]


def test_members_that_fit_are_kept_whole():
    members = _members(4)
    assert fit_addrs(members, sum(member_bytes(m.peer_id, m.addrs) for m in members)) is members


def test_addresses_past_the_first_are_trimmed_to_an_equal_share_in_order():
    members = _members(4)
    two = sum(member_bytes(m.peer_id, m.addrs[:2]) for m in members)
    fitted = fit_addrs(members, two)
    assert [m.addrs for m in fitted] == [ADDRS[:2]] * 4
    assert [m.peer_id for m in fitted] == [m.peer_id for m in members]
    assert [m.addrs for m in fit_addrs(members, two - 1)] == [ADDRS[:1]] * 4


def test_a_list_too_long_for_one_address_each_loses_its_last_members():
    members = _members(10)
    three = sum(member_bytes(m.peer_id, m.addrs[:1]) for m in members[:3])
    fitted = fit_addrs(members, three + 5)
    assert [m.peer_id for m in fitted] == [m.peer_id for m in members[:3]]
    assert all(m.addrs == ADDRS[:1] for m in fitted)


def test_a_relay_remembers_the_newest_announced_members_only(monkeypatch):
    """Catch-up sources and their addresses come from announcements; a long run's departed
    members do not pile up: past ``MAX_NOTED_PEERS`` the least recently announced are forgotten."""
    import trio

    from echorl.broadcast import relay as relay_mod
    from echorl.net.host import open_host

    monkeypatch.setattr(relay_mod, "MAX_NOTED_PEERS", 3)
    peers = [Identity.generate().peer_id for _ in range(5)]

    async def main():
        async with open_host(Identity.generate()) as host:
            relay = relay_mod.Relay(host, IDS[0], "r")
            relay._note_members(
                [PlanMember(peer_id=p, reachable=i != 1, addrs=ADDRS[:1]) for i, p in enumerate(peers[:3])]
            )
            assert list(relay.known_peers) == peers[:3] and relay._unreachable == {peers[1]}
            relay._note_members(
                [PlanMember(peer_id=p, reachable=True, addrs=ADDRS[:1]) for p in (peers[0], *peers[3:])]
            )
            assert list(relay.known_peers) == [peers[0], peers[3], peers[4]]  # re-announced: newest
            assert relay._unreachable == set()  # forgotten with its peer

    trio.run(main)
