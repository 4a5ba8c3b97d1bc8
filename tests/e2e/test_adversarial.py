"""A foreign peer attacks a real learner process: garbage bytes (before joining: refused unread),
an oversized frame, a forged signature, a submission signed by another key, a replay, a stale
version, a stale join. Each is refused with its error code (a forged signature also strikes its
sender off), the learner stays up, and the accepted count does not change."""

from __future__ import annotations

import json
import os
import secrets
import struct
import subprocess
import sys
import time

import trio
from libp2p.peer.id import ID
from swarm import ENV, remote_code, signed_submit

from echorl.net.framing import read_frame
from echorl.net.host import open_host
from echorl.node.receipts import check
from echorl.protocol import routes, wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import (
    Capability,
    JoinAccepted,
    JoinRequest,
    Lease,
    LeaseDeferred,
    LeaseRequest,
    Status,
    StatusRequest,
    SubmitAccepted,
)

# spot checks off: the one "genuine" submission here carries fabricated log-probs and must be
# accepted (log-prob spot checks are tested in test_net_spot_check.py)
CONFIG = {
    "prompts_per_step": 4,
    "prompts_per_lease": 4,
    "group_size": 2,
    "staleness": 0,
    "eval_every": 100000,
    "steps": 0,
    "spot_check_fraction": 0.0,
}


def _cap(addr: str) -> Capability:
    return Capability(
        engine="torch",
        device="cpu",
        memory_bytes=1,
        tokens_per_s=1.0,
        price_per_hour=0.0,
        reachable=True,
        listen_addrs=[addr],
    )


def _join_request(me: Identity, host) -> JoinRequest:
    """An unsigned join of ``me``, listening where ``host`` does, timestamped now."""
    return JoinRequest(
        run_id="echorl-demo",
        peer_id=me.peer_id,
        capability=_cap(host.addrs[0]),
        version=-1,
        timestamp=time.time(),
        nonce=secrets.token_bytes(16),
    )


async def _raw(host, peer: str, protocol: str, payload: bytes) -> str:
    stream = await host.libp2p.new_stream(ID.from_base58(peer), [protocol])
    await stream.write(payload)
    body = await read_frame(stream, max_bytes=1 << 20, first_byte_timeout=20, io_timeout=20)
    return wire.decode(body).code


async def _lease(host, learner: str, version: int) -> Lease:
    for _ in range(200):
        reply = await host.request(
            learner,
            routes.LEASE,
            LeaseRequest(run_id="echorl-demo", version=version, max_prompts=4),
            expect=(Lease, LeaseDeferred),
        )
        if isinstance(reply, Lease):
            return reply
        # "paced", or the version is trained but its publication has not begun (the learner
        # publishes one version at a time): it names the newest it published
        assert reply.reason == "paced" or (reply.reason == "weights_unknown" and reply.want_version < version), reply
        await trio.sleep(max(0.05, reply.retry_after_s))  # asking earlier is refused (rate_limited)
    raise AssertionError("no lease")


async def forge_once(addr: str, forge) -> tuple[str, str]:
    """A fresh identity joins and sends one forged submission, ``forge(identity)``: (the learner's
    answer to it, its answer to a lease request right after: a forger is struck off at its first
    forged signature, so the second stream is reset unread)."""
    me = Identity.generate()
    async with open_host(me) as host:
        learner = await host.connect(addr)
        join = _join_request(me, host)
        await host.request(learner, routes.JOIN, wire.sign(join, me), expect=JoinAccepted)
        first = await remote_code(host.request(learner, routes.SUBMIT, forge(me)))
        try:
            then = await remote_code(host.request(learner, routes.LEASE, LeaseRequest(run_id="echorl-demo", version=0)))
        except Exception:  # reset, disconnected
            then = "cut"
    return first, then


async def attack(addr: str) -> dict:
    me, other = Identity.generate(), Identity.generate()
    out: dict = {}
    async with open_host(me) as host:
        learner = await host.connect(addr)
        req = lambda proto, msg, **kw: host.request(learner, proto, msg, **kw)
        status = lambda: req(routes.STATUS, StatusRequest(), expect=Status)
        out["garbage"] = await _raw(host, learner, routes.SUBMIT, struct.pack(">I", 6) + b"\xc1garbg")
        out["oversized"] = await _raw(host, learner, routes.JOIN, struct.pack(">I", 10_000_000) + b"x" * 64)
        join = _join_request(me, host)
        old = join.model_copy(update={"timestamp": time.time() - 3600, "nonce": secrets.token_bytes(16)})
        out["stale_join"] = await remote_code(req(routes.JOIN, wire.sign(old, me)))
        out["forged_join"] = await remote_code(req(routes.JOIN, join.model_copy(update={"signature": b"\x01" * 64})))
        signed_join = wire.sign(join, me)
        assert isinstance(await req(routes.JOIN, signed_join, expect=JoinAccepted), JoinAccepted)
        out["garbage_joined"] = await _raw(host, learner, routes.SUBMIT, struct.pack(">I", 6) + b"\xc1garbg")
        out["replayed_join"] = await remote_code(req(routes.JOIN, signed_join))

        lease = await _lease(host, learner, 0)
        good = signed_submit(me, lease, 0, vary=True)  # distinct samples: paid (all-duplicate groups are not)
        before = (await status()).learner
        # forgeries, each by a fresh joined identity (the signature is checked before the lease):
        # each is answered with its code and strikes its sender off
        zeroed = lambda f: signed_submit(f, lease, 0).model_copy(update={"signature": b"\x02" * 64})
        out["forged"] = await forge_once(addr, zeroed)
        tampered = lambda f: signed_submit(f, lease, 0).model_copy(update={"generate_seconds": 9.0})
        out["tampered"] = await forge_once(addr, tampered)
        out["other_signer"] = await forge_once(addr, lambda f: signed_submit(f, lease, 0, signer=other))
        mid = (await status()).learner
        out["accepted_unchanged_by_refusals"] = mid["submissions_accepted"] == before["submissions_accepted"]
        ok = await req(routes.SUBMIT, good, expect=SubmitAccepted)
        assert isinstance(ok, SubmitAccepted) and ok.receipt is not None
        check(ok.receipt, learner, me.peer_id, "echorl-demo", lease.lease_id)  # signed by the pinned learner
        out["receipt_groups"] = ok.receipt.groups
        out["replay"] = await remote_code(req(routes.SUBMIT, good))
        out["replay_new_nonce"] = await remote_code(req(routes.SUBMIT, signed_submit(me, lease, 0)))
        # the learner trains a step on our 4 groups (S=0), then a version-0 result is stale
        for _ in range(400):
            if (await status()).learner["version"] >= 1:
                break
            await trio.sleep(0.05)
        lease2 = await _lease(host, learner, 1)
        out["stale"] = await remote_code(req(routes.SUBMIT, signed_submit(me, lease2, 0)))
        final = await status()
        after = final.learner
        out["me"] = next(p for p in final.peers if p["peer_id"] == me.peer_id)
        out["accepted"] = (before["submissions_accepted"], after["submissions_accepted"])
        out["invalid"] = after["rollouts_rejected_invalid"] - before["rollouts_rejected_invalid"]
    return out


def test_foreign_peer_attacks_are_refused(swarm, tmp_path):
    cfg = tmp_path / "learner.json"
    cfg.write_text(json.dumps(CONFIG))
    addr = swarm.start_learner("--config", str(cfg))
    out = trio.run(attack, addr)
    assert out["garbage"] == "not_found"  # not joined yet: the body is not even read
    assert out["garbage_joined"] == "malformed"
    assert out["oversized"] == "oversized"
    assert out["stale_join"] == "replay"
    assert out["forged_join"] == "bad_signature"
    assert out["replayed_join"] == "replay"
    assert out["forged"] == ("bad_signature", "cut")
    assert out["tampered"] == ("bad_signature", "cut")
    assert out["other_signer"] == ("wrong_signer", "cut")
    assert out["accepted_unchanged_by_refusals"]
    assert out["replay"] == "replay" and out["replay_new_nonce"] == "replay"
    assert out["stale"] == "stale_version"
    assert out["accepted"] == (0, 1)  # only the one genuine submission counted
    assert out["invalid"] == 3
    me = out["me"]  # the ledger: every refusal counted against us by reason, the one acceptance credited
    assert (me["rejected_replay"], me["rejected_stale_version"], me["submissions_rejected"]) == (2, 1, 3)
    assert me["top_rejection"] == "replay" and me["groups_accepted_total"] == out["receipt_groups"] == 4
    table = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "status", "--bootstrap", addr],
        env={**ENV, "COLUMNS": "120"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert table.returncode == 0 and "replay" in table.stdout, table.stderr
    print(table.stdout)
    assert swarm.learner.poll() is None  # still up
    st = trio.run(_alive, addr)
    assert st >= 1


async def _alive(addr: str) -> int:
    async with open_host(Identity.generate()) as host:
        peer = await host.connect(addr)
        reply = await host.request(peer, routes.STATUS, StatusRequest(), expect=Status)
        return int(reply.learner["version"])


_ = os
