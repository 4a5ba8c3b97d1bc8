"""A Sybil flood: hundreds of fresh identities, each with a real signed join, against a learner
with honest nodes. Joins beyond ``max_peers_per_ip`` from one address are refused
(``peer_limit``), plans hold the workers plus a few newcomers in turn, members that never work are
dropped in bounded time, oversized listen addresses are refused at the wire; against a real
learner process the honest node keeps contributing, steps keep coming and RSS stays bounded."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest
import trio
from pydantic import ValidationError
from swarm import remote_code
from test_hostile_rollouts import RUN, _service, tiny  # noqa: F401 - fixture

from echorl.learner.roster import MAX_MEMBER_ADDRS
from echorl.learner.service import LearnerService
from echorl.net.host import PeerUnavailable, RequestContext, open_host
from echorl.net.hostkey import ip_key
from echorl.protocol import routes, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Capability, JoinAccepted, JoinRequest


class FakeHost:
    """What the join handler asks of the host: where a peer's connection comes from."""

    def __init__(self) -> None:
        self.ips: dict[str, str] = {}

    def remote_ip(self, peer_id: str) -> str | None:
        return self.ips.get(peer_id)

    def add_peer_addrs(self, peer_id: str, addrs: list[str]) -> None:
        pass


def _join_msg(me: Identity, addrs: list[str] | None = None) -> JoinRequest:
    cap = Capability(
        engine="torch",
        device="cpu",
        memory_bytes=0,
        tokens_per_s=10.0,
        price_per_hour=0.0,
        reachable=False,
        listen_addrs=addrs if addrs is not None else [],
    )
    return wire.sign(
        JoinRequest(
            run_id=RUN,
            peer_id=me.peer_id,
            capability=cap,
            version=0,
            timestamp=time.time(),
            nonce=secrets.token_bytes(16),
        ),
        me,
    )


async def _join(svc: LearnerService, host: FakeHost, me: Identity, ip: str, addrs: list[str] | None = None) -> str:
    host.ips[me.peer_id] = ip
    ctx = RequestContext(peer_id=me.peer_id, protocol=routes.JOIN, received_at=time.time())
    try:
        assert isinstance(await svc.on_join(_join_msg(me, addrs), ctx), JoinAccepted)
    except ProtocolError as exc:
        return exc.code.value
    return "ok"


def _long_addrs(peer_id: str) -> list[str]:
    return [f"/dns4/{'a' * 60}.{'b' * 60}.{'c' * 60}.example/tcp/{4000 + i}/p2p/{peer_id}" for i in range(16)]


def test_flood_of_identities_is_capped_per_address_in_plans_and_in_time(tiny) -> None:  # noqa: F811
    async def main() -> None:
        svc = _service(tiny, max_peers_per_ip=32, plan_newcomers=16, idle_member_drop_s=600.0, dead_member_drop_s=60.0)
        host = FakeHost()
        svc.host = host  # type: ignore[assignment]
        honest = [Identity.generate() for _ in range(3)]
        for i, me in enumerate(honest):
            assert await _join(svc, host, me, f"10.0.0.{i + 1}") == "ok"
            svc.peers[me.peer_id].account.groups_accepted = 5  # has done work
            svc.peers[me.peer_id].account.submissions_accepted = 1
        sybils = [Identity.generate() for _ in range(250)]
        codes = [await _join(svc, host, me, "203.0.113.7", _long_addrs(me.peer_id)) for me in sybils]
        assert codes.count("ok") == 32 and codes.count(ErrorCode.PEER_LIMIT.value) == 218
        assert svc.roster.counters["joins_refused_ip_cap"] == 218 and len(svc.peers) == 35
        assert all(len(p.capability.listen_addrs) <= MAX_MEMBER_ADDRS for p in svc.peers.values())
        # the same host behind many IPv6 addresses of one /64 counts as one address
        v6 = [await _join(svc, host, Identity.generate(), f"2001:db8::{i:x}") for i in range(40)]
        assert v6.count("ok") == 32 and ip_key("2001:db8::1") == ip_key("2001:db8::ffff")
        # honest members re-join (a restart) while the flooding address is full: never refused
        for i, me in enumerate(honest):
            assert await _join(svc, host, me, f"10.0.0.{i + 1}") == "ok"
        joined = [me for me, c in zip(sybils, codes) if c == "ok"]
        assert await _join(svc, host, joined[0], "203.0.113.7") == "ok"  # a member's re-join keeps its slot

        infos = [svc.broadcast_nodes() for _ in range(4)]
        plans = [{n.peer_id for n in info} for info in infos]
        worker_ids = {me.peer_id for me in honest}
        for info in infos:  # newcomers are leaves once someone worked: a Sybil relays to nobody
            assert {n.peer_id for n in info if not n.leaf} == worker_ids
        for plan in plans:
            assert worker_ids <= plan and len(plan) == len(worker_ids) + 16
        newcomers = set().union(*plans) - worker_ids
        assert len(newcomers) == 64  # every plan offers newcomers not offered before (64 waiting)
        assert svc.roster.counters["plan_newcomers_capped"] == 4 * (64 - 16)
        st = svc.status()
        assert st.learner["plan_newcomers_capped"] == 4 * 48 and st.learner["joins_refused_ip_cap"] == 218 + 8

        # never worked: gone after idle_member_drop_s; one that holds a lease is kept; workers stay
        svc.note_published(0)
        keeper = joined[1]
        svc.leases.issue(keeper.peer_id, svc.buffer.next_prompts(svc.task, 1), 2, 0, time.monotonic(), 600.0)
        gone = svc.roster.drop_idle({keeper.peer_id}, now=time.monotonic() + 601.0)
        assert len(gone) == 64 - 1 and worker_ids | {keeper.peer_id} == set(svc.peers)
        assert await _join(svc, host, Identity.generate(), "203.0.113.7") == "ok"  # slots freed

    trio.run(main)


def test_dead_member_that_never_worked_is_dropped_soon(tiny) -> None:  # noqa: F811
    async def main() -> None:
        svc = _service(tiny, dead_member_drop_s=5.0)
        host = FakeHost()
        svc.host = host  # type: ignore[assignment]
        quiet, worker = Identity.generate(), Identity.generate()
        for me in (quiet, worker):
            assert await _join(svc, host, me, "198.51.100.1") == "ok"
            svc.peers[me.peer_id].alive = False  # both failed their liveness probe
        svc.peers[worker.peer_id].account.submissions_accepted = 1
        now = time.monotonic()
        assert svc.roster.idle(now=now + 2.0) == []
        assert svc.roster.idle(now=now + 6.0) == [quiet.peer_id]

    trio.run(main)


def test_oversized_listen_addresses_are_refused_at_the_wire() -> None:
    me = Identity.generate()
    with pytest.raises(ValidationError):
        _join_msg(me, ["/dns4/" + "a" * 600 + "/tcp/1"])
    with pytest.raises(ValidationError):
        _join_msg(me, ["/ip4/10.0.0.1/tcp/1"] * 17)
    assert len(wire.encode(_join_msg(me, _long_addrs(me.peer_id)))) < 12 * 1024


CONFIG = {
    "prompts_per_step": 4,
    "prompts_per_lease": 2,
    "group_size": 2,
    "staleness": 2,
    "eval_every": 100000,
    "steps": 0,
    "spot_check_fraction": 0.0,
    "checkpoint_dir": "none",
    "publish_every": 1,
    "chunk_cache_mb": 1.0,
}  # a full chunk cache would hide what the flood costs


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def flood(addr: str, n: int) -> list[str]:
    """``n`` identities, each its own libp2p host (one task each), connect and send a signed join;
    they stay connected, answering pings and never working, across a few steps and broadcasts."""
    codes: list[str] = []
    joined = trio.Semaphore(20)  # 20 joins at a time
    stop = trio.Event()

    async def one() -> None:
        me, answered = Identity.generate(), False
        try:
            async with open_host(me) as host:
                async with joined:
                    try:
                        learner = await host.connect(addr)
                    except PeerUnavailable:  # the learner's per-address connection cap (net/guard.py)
                        codes.append("connection_refused")
                        return
                    msg = _join_msg(me, _long_addrs(me.peer_id))
                    codes.append(await remote_code(host.request(learner, routes.JOIN, msg, expect=JoinAccepted)))
                    answered = True
                await stop.wait()
        except (Exception, BaseExceptionGroup) as exc:  # a refused sybil's host, disconnected, may fail
            if not answered:
                codes.append(f"host failed: {type(exc).__name__}")

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
        with trio.move_on_after(120):
            while len(codes) < n:
                await trio.sleep(0.1)
        await trio.sleep(8.0)
        stop.set()
    return codes


def _flood_in_a_process(addr: str, n: int) -> list[str]:
    """:func:`flood` in its own process: its sockets close when it exits (a py-libp2p host that
    exits inside a process leaves them open, and the learner would count them as connected)."""
    import subprocess
    import sys

    from swarm import ENV

    here = Path(__file__).parent
    code = (
        f"import json, sys, trio; sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]; "
        f"from test_sybil_flood import flood; print(json.dumps(trio.run(flood, {addr!r}, {n})))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_sybil_flood_against_a_real_learner(swarm, tmp_path) -> None:
    cfg = tmp_path / "learner.json"
    cfg.write_text(json.dumps(CONFIG))
    addr = swarm.start_learner("--config", str(cfg))
    node = swarm.start_node("honest")
    swarm.wait_for(lambda: any(r.get("step", 0) >= 8 for r in swarm.metrics()), timeout=240, what="8 steps")
    rss_before = _rss_mb(swarm.learner.pid)
    start = max(r["step"] for r in swarm.metrics())
    codes = _flood_in_a_process(addr, 220)
    # 31 admitted (the honest node holds the address's 32nd slot); the rest refused: at the join
    # (peer_limit) or, once the address holds 48 connections, at the connection (net/guard.py)
    assert len(codes) == 220 and codes.count("ok") == 31, sorted(set(codes))
    assert codes.count(ErrorCode.PEER_LIMIT.value) > 0 and codes.count("connection_refused") > 0
    swarm.wait_for(
        lambda: max(r.get("step", 0) for r in swarm.metrics()) >= start + 4,
        timeout=240,
        what="4 more steps after the flood",
    )
    rss_after = _rss_mb(swarm.learner.pid)
    assert rss_after - rss_before < 100.0, (rss_before, rss_after)
    rows = [r for r in swarm.metrics() if r.get("step", 0) > start]
    assert (
        rows[-1]["joins_refused_ip_cap"] >= codes.count(ErrorCode.PEER_LIMIT.value) > 0
    )  # some replies lost to the close
    assert rows[-1]["connections_refused"] >= codes.count("connection_refused")
    assert max(r.get("broadcast_nodes") or 0 for r in rows) <= 1 + 16  # the worker + at most 16 newcomers
    st = swarm.status()
    mine = [p for p in st["peers"] if p["groups_accepted"] > 0]
    assert len(mine) == 1 and mine[0]["alive"] and not mine[0]["banned"]
    assert node.poll() is None
    log = (tmp_path / "honest.log").read_text()
    assert "peer_limit" not in log and "not_found" not in log
