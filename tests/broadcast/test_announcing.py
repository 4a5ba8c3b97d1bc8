"""Which members the learner leaves to their stripe-0 parent (``forward_flags``), and when it
sends its own copy to one not heard from (``AnnounceRound``)."""

from __future__ import annotations

from types import SimpleNamespace

import trio
import trio.testing

from echorl.broadcast.announcing import NO_FORWARD_FOR, AnnounceRound, Forwarders, forward_flags
from echorl.broadcast.deadlines import Deadlines
from echorl.broadcast.store import plan_for
from echorl.net.host import PeerUnavailable
from echorl.protocol.messages import PlanMember

L = "Learner".ljust(40, "L")


def pid(name: str) -> str:
    """A peer ID as the wire allows one (base58, ≥ 32 characters), readable in a failure."""
    return name.replace("0", "o").replace("l", "L").ljust(40, "z")


def members(n: int, unreachable: frozenset[str] = frozenset()) -> list[PlanMember]:
    ids = [pid(f"p{i:02d}") for i in range(n)]
    return [PlanMember(peer_id=p, reachable=p not in unreachable, addrs=[]) for p in ids]


def test_heads_newcomers_and_their_children_get_the_learners_copy():
    ms = members(30)
    plan = plan_for(L, ms, "striped", 3, 7)
    parent = plan.stripes[0].parent_of()
    everyone = {m.peer_id for m in ms}
    assert forward_flags(plan, ms, set(), {}) == set()  # the first version: nobody holds a plan naming a parent
    flagged = forward_flags(plan, ms, everyone, parent)
    heads = {p for p, q in parent.items() if q == L}
    assert flagged == everyone - heads and heads  # the learner sends only to its own stripe-0 children
    newcomer = next(p for p in everyone - heads if plan.stripes[0].children.get(p))
    flagged = forward_flags(plan, ms, everyone - {newcomer}, parent)
    assert newcomer not in flagged  # holds no plan: would not admit a parent's copy
    assert not flagged & set(plan.stripes[0].children[newcomer])  # nor would a newcomer's child admit it
    assert forward_flags(plan_for(L, ms, "star", 3, 7), ms, everyone, {}) == set()


def test_a_member_behind_nat_is_forwarded_to_only_under_the_parent_it_dialled_last_time():
    ms0 = members(30)
    plan0 = plan_for(L, ms0, "striped", 3, 7)
    parent = plan0.stripes[0].parent_of()
    inner = next(p for p, q in parent.items() if q != L)
    ms = members(30, unreachable=frozenset({inner}))
    plan = plan_for(L, ms, "striped", 3, 7)
    new_parent = plan.stripes[0].parent_of()[inner]
    everyone = {m.peer_id for m in ms}
    same = forward_flags(plan, ms, everyone, {inner: new_parent})
    moved = forward_flags(plan, ms, everyone, {inner: "someone-else"})
    assert (inner in same) == (new_parent != L) and inner not in moved


def test_a_member_not_heard_from_gets_the_learners_copy_at_its_depths_deadline():
    class FakeHost:
        def __init__(self) -> None:
            self.sent: list[tuple[str, float]] = []

        async def request(self, peer, route, body, *, expect, timeout):
            self.sent.append((peer, trio.current_time()))
            if peer == dead:
                raise PeerUnavailable("gone")

    head, dead, heard, silent = (pid(x) for x in ("head", "dead", "heard", "silent"))

    async def main():
        host = FakeHost()
        ms = [PlanMember(peer_id=p, reachable=True, addrs=[]) for p in (head, dead, heard, silent)]
        depth = {head: 1, dead: 1, heard: 2, silent: 3}
        changes = []
        r = AnnounceRound(
            host, b"x", ms, {heard, silent}, depth, timeout_s=5.0, hop_s=1.0, on_change=lambda: changes.append(1)
        )
        async with trio.open_nursery() as n:
            n.start_soon(r.run)
            await trio.sleep(1.5)
            r.heard(heard)  # its parent forwarded it: the learner sends nothing
            assert r.asked == {silent}
        assert {p for p, _ in host.sent[:2]} == {head, dead} and host.sent[2][0] == silent and len(host.sent) == 3
        assert host.sent[-1][1] >= 3.0  # depth 3 × 1 s
        assert r.took == {head, heard, silent} and r.sent == 3 and r.heard_count == 1 and changes
        r.heard(silent)  # settled already: counted once
        assert r.heard_count == 1

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_parent_that_left_a_child_to_the_learner_is_not_relied_on_for_a_while():
    ms = members(30)
    plan = plan_for(L, ms, "striped", 3, 7)
    parent = plan.stripes[0].parent_of()
    everyone = {m.peer_id for m in ms}
    child = next(c for c, p in parent.items() if p != L)
    withholder = parent[child]

    def round_(late: set[str]) -> SimpleNamespace:  # what ``note`` reads of an AnnounceRound
        return SimpleNamespace(sent=len(late), heard_count=0, fell_back=late)

    fw = Forwarders()
    fw.note(plan, everyone, round_(set()), 0)
    assert child in fw.flags(plan, ms, 1)
    fw.note(plan, everyone, round_({child}), 1)  # publication 1: the learner had to send the child its copy
    assert child not in fw.flags(plan, ms, 2) and fw.flags(plan, ms, 2) == forward_flags(plan, ms, everyone, parent) - {
        c for c, p in parent.items() if p == withholder
    }
    for n in range(2, 2 + NO_FORWARD_FOR):
        fw.note(plan, everyone, round_(set()), n)
    assert child in fw.flags(plan, ms, 2 + NO_FORWARD_FOR)  # relied on again
    fw.note(plan, everyone, round_({child}), 18)  # withheld again: out twice as long
    assert child not in fw.flags(plan, ms, 18 + 2 * NO_FORWARD_FOR) and child in fw.flags(
        plan, ms, 19 + 2 * NO_FORWARD_FOR
    )
    fw.benched.clear()
    fw.note(plan, everyone - {withholder}, round_({child}), 80)  # a parent that took nothing is not blamed
    assert fw.benched == {} and fw.counters["announce_late"] == 3 and fw.counters["announce_sends"] == 3


def test_the_forward_deadline_grows_with_the_bytes_and_the_copies():
    d = Deadlines()
    small, big = d.for_forward(10_000, 4), d.for_forward(1_250_000, 4)
    assert 2.0 < small < 2.2 and big > small and d.for_forward(1_250_000, 8) > big
