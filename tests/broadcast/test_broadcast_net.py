"""Broadcast with real relay peers in separate OS processes on loopback: tampered chunk, killed
relay, bad manifest signature, late joiner (full snapshot + deltas from peers)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import trio
from swarm import safetensors_f32

from echorl.broadcast.broadcaster import Broadcaster, NodeInfo
from echorl.broadcast.store import plan_for, plan_of
from echorl.net.host import HostConfig, RemoteError, open_host
from echorl.net.transport import UploadLimiter
from echorl.protocol import wire
from echorl.protocol.errors import ErrorCode
from echorl.protocol.identity import Identity
from echorl.protocol.messages import BroadcastAck, PlanAnnounce, PlanMember
from echorl.protocol.routes import ANNOUNCE

pytestmark = pytest.mark.timeout(120)
RUN = "t-bcast"


RELAY = ["-m", "echorl.broadcast.relay_process"]
TAMPERING_RELAY = [os.path.join(os.path.dirname(__file__), "tampering_relay.py")]  # the test double
SILENT_RELAY = [os.path.join(os.path.dirname(__file__), "silent_relay.py")]  # forwards no announcement


class Peer:
    """One relay peer process (``python -m echorl.broadcast.relay_process``), its JSON events collected."""

    def __init__(self, learner_addr: str, *args: str, program: list[str] = RELAY) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, *program, "--learner", learner_addr, "--run-id", RUN, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        self.events: list[dict] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            ev = json.loads(line)
            self.events.append(ev)
            if ev["event"] == "ready":
                self.peer_id, self.addrs = ev["peer_id"], ev["addrs"]
                self.ready.set()

    async def wait_ready(self) -> Peer:
        ok = await trio.to_thread.run_sync(self.ready.wait, 60)
        assert ok, "relay peer did not start"
        return self

    def info(self) -> NodeInfo:
        return NodeInfo(self.peer_id, True, tuple(self.addrs))

    def versions(self) -> dict[int, str]:
        return {e["version"]: e["digest"] for e in self.events if e["event"] == "version"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


async def start_peers(learner_addr: str, n: int, *args: str) -> list[Peer]:
    peers = [Peer(learner_addr, *args) for _ in range(n)]
    for p in peers:
        await p.wait_ready()
    return peers


async def wait_version(peers: list[Peer], version: int, timeout: float = 30.0) -> None:
    with trio.fail_after(timeout):
        while not all(version in p.versions() for p in peers):
            await trio.sleep(0.05)


def adopted_stripes(peer: Peer) -> int:
    """Stripes an ancestor completed for ``peer`` after their parent failed, as of its newest version."""
    return next(e["adopted"] for e in reversed(peer.events) if e["event"] == "version")


def interior_version(bc: Broadcaster, nodes: list[NodeInfo], who: str, start: int) -> int:
    """The first version >= start whose plan (seed = version) gives ``who`` children."""
    for v in range(start, start + 200):
        ann = PlanAnnounce(
            run_id=RUN,
            learner_peer_id=bc.identity.peer_id,
            version=v,
            manifest=_dummy_manifest(bc.identity, v),
            shape=bc.shape,
            fanout=bc.fanout,
            seed=v,
            learner_addrs=[],
            members=[PlanMember(peer_id=n.peer_id, reachable=True, addrs=[]) for n in nodes],
            created_at=0.0,
        )
        plan = plan_of(ann)
        if any(plan.children(who, s) for s in range(len(plan.stripes))):
            return v
    raise AssertionError("no plan makes the peer interior")


def stripe0_plan(bc: Broadcaster, nodes: list[NodeInfo], who: str, interior: bool):
    """A seed (and its plan) that gives ``who`` stripe-0 children (``interior``) or none."""
    ms = [PlanMember(peer_id=n.peer_id, reachable=True, addrs=[]) for n in nodes]
    for seed in range(1, 200):
        plan = plan_for(bc.identity.peer_id, ms, bc.shape, bc.fanout, seed)
        if bool(plan.children(who, 0)) == interior and not plan.children(bc.identity.peer_id, 0).count(who):
            return seed, plan
    raise AssertionError("no such plan")


def _dummy_manifest(identity: Identity, v: int):
    from echorl.protocol import snapshot

    data = safetensors_f32(np.zeros(4, dtype=np.float32))
    return snapshot.build_manifest(identity, RUN, v, -1, data, data)[0]


def run_learner(body, **bc_kwargs):
    async def main():
        identity = Identity.generate()
        async with open_host(identity, HostConfig()) as host:
            bc = Broadcaster(host, identity, RUN, **bc_kwargs)
            bc.install()
            peers: list[Peer] = []
            try:
                await body(host, bc, peers)
            finally:
                for p in peers:
                    p.stop()

    trio.run(main)


def test_tampering_relay_is_detected_and_its_children_adopted_and_reported():
    async def body(host, bc, peers):
        bad = Peer(host.addrs[0], "--stall-s", "5", program=TAMPERING_RELAY)
        peers.append(bad)
        peers.extend(await start_peers(host.addrs[0], 4, "--stall-s", "5"))
        await bad.wait_ready()
        nodes = [p.info() for p in peers]
        v = interior_version(bc, nodes, bad.peer_id, 1)
        data = safetensors_f32(np.random.default_rng(0).standard_normal(300_000).astype(np.float32))
        report = await bc.publish(v, data, nodes, timeout=60, seed=v)
        assert sorted(report.completed) == sorted(p.peer_id for p in peers), report
        assert report.suspects == [bad.peer_id]
        await wait_version(peers, v)
        # its children took the rest of its stripes from an ancestor (adoption), a chunk pulled at most
        assert sum(adopted_stripes(p) for p in peers if p is not bad) >= 1
        for p in peers:
            assert p.versions()[v] == hashlib.sha256(data).hexdigest()
        # the next plan keeps the tamperer only as a leaf: no one depends on it
        report2 = await bc.publish(v + 1, data[:-4] + b"\0\0\0\0", nodes, timeout=60, seed=v)
        assert len(report2.completed) == 5 and report2.suspects == []

    run_learner(body, fanout=2, chunk_bytes=64 * 1024, upload_limit=UploadLimiter.from_mbps(200))


def test_relay_killed_mid_broadcast_others_complete_and_next_plan_drops_it():
    """The killed relay's children take the rest of each of its stripes from an ancestor (one
    stream, forwarded on to their own children as before): no chunk is pulled one by one."""

    async def body(host, bc, peers):
        peers.extend(await start_peers(host.addrs[0], 6, "--stall-s", "1.5", "--upload-mbps", "16"))
        nodes = [p.info() for p in peers]
        victim = peers[0]
        v = interior_version(bc, nodes, victim.peer_id, 1)
        data = safetensors_f32(np.random.default_rng(1).standard_normal(1_000_000).astype(np.float32))  # 4 MB

        async def kill_soon():
            await trio.sleep(1.0)
            victim.proc.kill()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_soon)
            report = await bc.publish(v, data, nodes, timeout=60, seed=v)
        survivors = [p for p in peers if p is not victim]
        assert sorted(report.completed) == sorted(p.peer_id for p in survivors), report
        assert report.missing == [victim.peer_id]
        assert victim.peer_id in report.suspects
        assert report.seconds < 20  # the dead relay is detected (ping), not waited for until the timeout
        await wait_version(survivors, v)
        for p in survivors:
            assert p.versions()[v] == hashlib.sha256(data).hexdigest()
        adopted = {p.peer_id[-6:]: adopted_stripes(p) for p in survivors}
        assert sum(adopted.values()) >= 1 and report.recovered_chunks == 0, (report, adopted)
        # next version: the dead relay is not in the plan, everyone else completes without recovery
        data2 = data[:-4] + b"\1\1\1\1"
        report2 = await bc.publish(v + 1, data2, nodes, timeout=60, seed=v)
        assert report2.nodes == 5 and len(report2.completed) == 5 and report2.missing == []

    run_learner(body, fanout=2, chunk_bytes=128 * 1024, upload_limit=UploadLimiter.from_mbps(16))


def test_the_announcement_goes_down_the_plan_and_a_silent_forwarder_costs_only_its_subtree_a_deadline():
    async def body(host, bc, peers):
        silent = Peer(host.addrs[0], program=SILENT_RELAY)
        peers.append(silent)
        peers.extend(await start_peers(host.addrs[0], 6))
        await silent.wait_ready()
        nodes, everyone = [p.info() for p in peers], sorted(p.peer_id for p in peers)
        rng = np.random.default_rng(2)
        versions = [safetensors_f32(rng.standard_normal(50_000).astype(np.float32)) for _ in range(3)]
        first = await bc.publish(1, versions[0], nodes, timeout=60, seed=1)
        assert first.announce_sends == 7 and first.announce_heard == 0 and first.completed == everyone
        # the silent relay a leaf of stripe 0: the learner sends to its own stripe-0 children only
        seed, plan = stripe0_plan(bc, nodes, silent.peer_id, interior=False)
        heads = plan.children(bc.identity.peer_id, 0)
        second = await bc.publish(2, versions[1], nodes, timeout=60, seed=seed)
        assert second.completed == everyone
        assert (second.announce_sends, second.announce_heard) == (len(heads), 7 - len(heads)), second
        # interior: the members below it get the learner's copy at their depth's deadline, the rest
        # still take it from their parents, and every member has the version
        seed, plan = stripe0_plan(bc, nodes, silent.peer_id, interior=True)
        heads, below = plan.children(bc.identity.peer_id, 0), plan.children(silent.peer_id, 0)
        subtree = {p for p, d in plan.stripes[0].depth_of(bc.identity.peer_id).items() if p in below} | {
            c for b in below for c in plan.children(b, 0)
        }
        third = await bc.publish(3, versions[2], nodes, timeout=60, seed=seed)
        assert third.completed == everyone, third
        assert len(heads) + len(below) <= third.announce_sends <= len(heads) + len(subtree), third
        assert third.announce_heard == 7 - third.announce_sends and third.announce_late >= len(below)
        await wait_version(peers, 3)
        assert {p.versions()[3] for p in peers} == {hashlib.sha256(versions[2]).hexdigest()}
        # then it is not relied on: the members below it get the learner's copy at once
        fourth = await bc.publish(4, versions[0], nodes, timeout=60, seed=seed)
        assert fourth.completed == everyone and fourth.announce_late == 0, fourth
        assert fourth.announce_sends == len(heads) + len(below) and fourth.announce_heard == 7 - fourth.announce_sends

    run_learner(body, fanout=2, chunk_bytes=64 * 1024)


def test_a_member_can_pass_on_only_what_the_learner_signed():
    """A member of a held plan may send a node an announcement (it passes the learner's on); one it
    signed itself is refused and changes nothing, a copy of a version the node holds is answered."""
    from hostile import plan_member

    async def body(host, bc, peers):
        peers.extend(await start_peers(host.addrs[0], 1))
        node = peers[0]
        member_id = Identity.generate()
        async with open_host(member_id, HostConfig()) as member, trio.open_nursery() as nursery:
            plan_member(member, nursery, bc.identity.peer_id, report=True, run_id=RUN)
            await member.connect(host.addrs[0])
            await member.connect(node.addrs[0])
            nodes = [node.info(), NodeInfo(member_id.peer_id, True, tuple(member.addrs))]
            data = safetensors_f32(np.arange(1000, dtype=np.float32))
            report = await bc.publish(1, data, nodes, timeout=30)
            assert node.peer_id in report.completed
            await wait_version([node], 1)
            genuine = next(iter(bc.server.states.values())).announce
            ack = await member.request(node.peer_id, ANNOUNCE, genuine, expect=BroadcastAck)
            assert ack.have_version == 1  # a copy of what it holds: answered, nothing to do
            forged = wire.sign(
                genuine.model_copy(update={"version": 2, "learner_peer_id": member_id.peer_id}), member_id
            )
            with pytest.raises(RemoteError) as info:
                await member.request(node.peer_id, ANNOUNCE, forged, expect=BroadcastAck)
            assert info.value.code in (ErrorCode.WRONG_SIGNER, ErrorCode.BAD_SIGNATURE)
            assert set(node.versions()) == {1}
            nursery.cancel_scope.cancel()

    run_learner(body, fanout=2, chunk_bytes=1024)


def test_bad_signatures_are_refused():
    async def body(host, bc, peers):
        peers.extend(await start_peers(host.addrs[0], 1))
        node = peers[0]
        await host.connect(node.addrs[0])
        data = safetensors_f32(np.arange(1000, dtype=np.float32))
        from echorl.protocol import snapshot

        manifest, _ = snapshot.build_manifest(bc.identity, RUN, 1, -1, data, data, chunk_bytes=1024)
        member = [PlanMember(peer_id=node.peer_id, reachable=True, addrs=node.addrs)]

        def announce(m, signer=bc.identity):
            return wire.sign(
                PlanAnnounce(
                    run_id=RUN,
                    learner_peer_id=signer.peer_id,
                    version=1,
                    manifest=m,
                    shape="striped",
                    fanout=2,
                    seed=1,
                    learner_addrs=host.addrs,
                    members=member,
                    created_at=time.time(),
                ),
                signer,
            )

        # a manifest whose signature is broken, inside a validly signed announcement
        bad_manifest = manifest.model_copy(update={"signature": bytes(64)})
        with pytest.raises(RemoteError) as info:
            await host.request(node.peer_id, ANNOUNCE, announce(bad_manifest), expect=BroadcastAck)
        assert info.value.code == ErrorCode.BAD_SIGNATURE
        # a manifest whose content was altered after signing
        forged = manifest.model_copy(update={"version": 2})
        with pytest.raises(RemoteError) as info:
            await host.request(node.peer_id, ANNOUNCE, announce(forged), expect=BroadcastAck)
        assert info.value.code == ErrorCode.BAD_SIGNATURE
        # an announcement (plan) altered after signing: a relay cannot redirect traffic
        ann = announce(manifest)
        redirected = ann.model_copy(update={"fanout": 3})
        with pytest.raises(RemoteError) as info:
            await host.request(node.peer_id, ANNOUNCE, redirected, expect=BroadcastAck)
        assert info.value.code == ErrorCode.BAD_SIGNATURE
        # signed by another key claiming to be the learner: wrong signer
        other = Identity.generate()
        with pytest.raises(RemoteError) as info:
            await host.request(node.peer_id, ANNOUNCE, announce(manifest, other), expect=BroadcastAck)
        assert info.value.code in (ErrorCode.WRONG_SIGNER, ErrorCode.BAD_SIGNATURE)
        assert node.versions() == {}
        # the genuine one is accepted and applied
        report = await bc.publish(1, data, [node.info()], timeout=30)
        assert report.completed == [node.peer_id]
        await wait_version([node], 1)

    run_learner(body, fanout=2, chunk_bytes=1024)


def test_late_joiner_catches_up_from_peers_then_follows_deltas():
    async def body(host, bc, peers):
        peers.extend(await start_peers(host.addrs[0], 3))
        nodes = [p.info() for p in peers]
        rng = np.random.default_rng(2)
        w = rng.standard_normal(250_000).astype(np.float32)
        files = {}
        kinds = []
        for v in range(1, 5):
            if v > 1:
                idx = rng.choice(w.size, w.size // 100, replace=False)
                w[idx] += 0.01
            files[v] = safetensors_f32(w)
            report = await bc.publish(v, files[v], nodes, timeout=30)
            assert len(report.completed) == 3
            kinds.append(report.kind)
            if report.kind == "delta":
                assert report.bytes < report.result_bytes / 5
        assert kinds == ["full", "delta", "delta", "delta"]
        await wait_version(peers, 4)
        for p in peers:
            assert p.versions()[4] == hashlib.sha256(files[4]).hexdigest()
        # a late joiner: newest full snapshot + the deltas after it, from a peer
        late = Peer(host.addrs[0], "--catch-up", "--source", peers[0].addrs[0])
        peers.append(late)
        await late.wait_ready()
        assert late.events[-1]["version"] == 4
        assert late.versions()[4] == hashlib.sha256(files[4]).hexdigest()
        # and from now on it follows the broadcast (deltas) like everyone
        w[:100] += 1.0
        files[5] = safetensors_f32(w)
        report = await bc.publish(5, files[5], [p.info() for p in peers], timeout=30)
        assert report.kind == "delta" and len(report.completed) == 4
        await wait_version(peers, 5)
        assert {p.versions()[5] for p in peers} == {hashlib.sha256(files[5]).hexdigest()}

    run_learner(body, fanout=2, chunk_bytes=64 * 1024, full_every=10)
