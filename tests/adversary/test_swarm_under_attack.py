"""A real learner process and an honest node process, attacked by one joined foreign peer (and
one that never joins) with every hostile-but-well-formed input at once. The learner stays up and
keeps stepping, every step's loss is finite, status answers, the honest node is never refused,
and each attack is refused with its code."""

from __future__ import annotations

import json
import math
import secrets
import struct
import time

import trio
from libp2p.peer.id import ID

from echorl.protocol import routes
from echorl.net.framing import read_frame
from echorl.net.host import open_host
from echorl.protocol import wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import (
    Capability, JoinAccepted, JoinRequest, Lease, LeaseDeferred, LeaseRequest, Status, StatusRequest,
)

from swarm import remote_code, signed_submit

CONFIG = {"prompts_per_step": 4, "prompts_per_lease": 2, "group_size": 2, "staleness": 2, "eval_every": 100000,
          "steps": 0, "spot_check_fraction": 0.0, "checkpoint_dir": "none"}


async def _lease(host, learner: str) -> tuple[Lease, int]:
    """A lease for the newest published version (the learner names it when asked for a newer one)."""
    version = 2**40
    for _ in range(400):
        reply = await host.request(learner, routes.LEASE, LeaseRequest(run_id="echorl-demo", version=version,
                                                                       max_prompts=2), expect=(Lease, LeaseDeferred))
        if isinstance(reply, Lease):
            return reply, version
        if reply.want_version >= 0:
            version = reply.want_version
        await trio.sleep(max(0.05, min(reply.retry_after_s, 1.0)))
    raise AssertionError("no lease")


async def attack(addr: str) -> dict:
    me = Identity.generate()
    out: dict = {}
    async with open_host(me) as host, open_host(Identity.generate()) as stranger:
        learner = await host.connect(addr)
        # a peer that never joined: a 4 MiB SUBMIT header is answered at once, unread
        await stranger.connect(addr)
        stream = await stranger.libp2p.new_stream(ID.from_base58(learner), [routes.SUBMIT])
        await stream.write(struct.pack(">I", 4 * 1024 * 1024) + b"\0" * 64)
        with trio.fail_after(5):
            out["unjoined_frame"] = wire.decode(await read_frame(stream, max_bytes=1 << 16, first_byte_timeout=5,
                                                                 io_timeout=5)).code
        cap = Capability(engine="torch", device="cpu", memory_bytes=1, tokens_per_s=0.0, price_per_hour=0.0,
                         reachable=True, listen_addrs=[host.addrs[0]])
        join = JoinRequest(run_id="echorl-demo", peer_id=me.peer_id, capability=cap, version=-1,
                           timestamp=time.time(), nonce=secrets.token_bytes(16))
        await host.request(learner, routes.JOIN, wire.sign(join, me), expect=JoinAccepted)
        submit = lambda msg: remote_code(host.request(learner, routes.SUBMIT, msg))  # noqa: E731

        lease, v = await _lease(host, learner)
        hoard = await host.request(learner, routes.LEASE, LeaseRequest(run_id="echorl-demo", version=0, max_prompts=2))
        out["second_lease"] = getattr(hoard, "reason", type(hoard).__name__)
        poison = signed_submit(me, lease, v, token_ids=(4,), logprobs=(-1.0,))
        body = bytearray(wire.encode(poison))
        at = body.find(b"\xcb\xbf\xf0\x00\x00\x00\x00\x00\x00")  # float64 -1.0 -> ≈ -1e300
        body[at + 1: at + 9] = bytes.fromhex("fe3c9e7d1f2a4c3b")
        stream = await host.libp2p.new_stream(ID.from_base58(learner), [routes.SUBMIT])
        await stream.write(struct.pack(">I", len(body)) + bytes(body))
        out["logprob_-1e300"] = wire.decode(await read_frame(stream, max_bytes=1 << 16, first_byte_timeout=10,
                                                             io_timeout=10)).code
        st = (await host.request(learner, routes.STATUS, StatusRequest(), expect=Status)).learner
        out["unpublished"] = await submit(signed_submit(me, lease, int(st["version"]) + 1, token_ids=(4,), logprobs=(-1.0,)))
        lease, v = await _lease(host, learner)
        out["after_eos"] = await submit(signed_submit(me, lease, v, token_ids=(4, 1, 5), logprobs=(-1.0,) * 3))
        lease, v = await _lease(host, learner)
        tiny_time = signed_submit(me, lease, v, token_ids=(4,), logprobs=(-80.0,))
        tiny_time = wire.sign(tiny_time.model_copy(update={"generate_seconds": 5e-324}), me)
        out["tiny_time_far_logprob"] = await submit(tiny_time)
        out["status_after"] = type(await host.request(learner, routes.STATUS, StatusRequest())).__name__
    return out


def test_learner_keeps_stepping_under_every_attack(swarm, tmp_path):
    cfg = tmp_path / "learner.json"
    cfg.write_text(json.dumps(CONFIG))
    addr = swarm.start_learner("--config", str(cfg))
    swarm.start_node("honest")
    swarm.wait_for(lambda: any(r.get("step", 0) >= 2 for r in swarm.metrics()), timeout=240, what="2 steps")
    out = trio.run(attack, addr)
    assert out == {"unjoined_frame": "not_found", "second_lease": "paced", "logprob_-1e300": "schema",
                   "unpublished": "unpublished_version", "after_eos": "bad_rollout",
                   "tiny_time_far_logprob": "ok", "status_after": "Status"}, out
    start = max(r.get("step", 0) for r in swarm.metrics())
    swarm.wait_for(lambda: max(r.get("step", 0) for r in swarm.metrics()) >= start + 3, timeout=240,
                   what="3 more steps after the attacks")
    assert swarm.learner.poll() is None
    rows = [r for r in swarm.metrics() if r.get("step", 0) >= 1]
    assert all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["train_steps_skipped_nonfinite"] == 0
    st = swarm.status()
    honest = [p for p in st["peers"] if p["groups_accepted"] > 0 and not p["banned"]]
    assert honest and all(r["rollouts_rejected_invalid"] == 0 for r in rows[-1:])
