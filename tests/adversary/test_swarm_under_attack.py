"""A real learner process and an honest node process, attacked by one joined foreign peer (and
one that never joins) with every hostile-but-well-formed input at once. The learner stays up and
keeps stepping, every step's loss is finite, status answers, the honest node is never refused,
and each attack is refused with its code."""

from __future__ import annotations

import json
import math

import trio
from hostile import framed, join, newest_lease, nonfinite_logprob_body, oversized_header, raw_request
from swarm import remote_code, signed_submit

from echorl.net.host import open_host
from echorl.protocol import routes, wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import LeaseRequest, Status, StatusRequest

CONFIG = {
    "prompts_per_step": 4,
    "prompts_per_lease": 2,
    "group_size": 2,
    "staleness": 2,
    "eval_every": 100000,
    "steps": 0,
    "spot_check_fraction": 0.0,
    "checkpoint_dir": "none",
}


async def attack(addr: str) -> dict:
    me = Identity.generate()
    out: dict = {}
    async with open_host(me) as host, open_host(Identity.generate()) as stranger:
        learner = await host.connect(addr)
        # a peer that never joined: a 4 MiB SUBMIT header is answered at once, unread
        await stranger.connect(addr)
        with trio.fail_after(5):
            out["unjoined_frame"] = await raw_request(stranger, learner, routes.SUBMIT, oversized_header(4 << 20), 5)
        await join(host, learner, me, tokens_per_s=0.0)
        submit = lambda msg: remote_code(host.request(learner, routes.SUBMIT, msg))

        lease, v = await newest_lease(host, learner)
        hoard = await host.request(learner, routes.LEASE, LeaseRequest(run_id="echorl-demo", version=0, max_prompts=2))
        out["second_lease"] = getattr(hoard, "reason", type(hoard).__name__)
        await trio.sleep(getattr(hoard, "retry_after_s", 0.0))  # asking again earlier is refused
        poison = nonfinite_logprob_body(signed_submit(me, lease, v, token_ids=(4,), logprobs=(-1.0,)))
        out["logprob_-1e300"] = await raw_request(host, learner, routes.SUBMIT, framed(poison), 10)
        st = (await host.request(learner, routes.STATUS, StatusRequest(), expect=Status)).learner
        out["unpublished"] = await submit(
            signed_submit(me, lease, int(st["version"]) + 1, token_ids=(4,), logprobs=(-1.0,))
        )
        lease, v = await newest_lease(host, learner)
        out["after_eos"] = await submit(signed_submit(me, lease, v, token_ids=(4, 1, 5), logprobs=(-1.0,) * 3))
        lease, v = await newest_lease(host, learner)
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
    assert out == {
        "unjoined_frame": "not_found",
        "second_lease": "paced",
        "logprob_-1e300": "schema",
        "unpublished": "unpublished_version",
        "after_eos": "bad_rollout",
        "tiny_time_far_logprob": "ok",
        "status_after": "Status",
    }, out
    start = max(r.get("step", 0) for r in swarm.metrics())
    swarm.wait_for(
        lambda: max(r.get("step", 0) for r in swarm.metrics()) >= start + 3,
        timeout=240,
        what="3 more steps after the attacks",
    )
    assert swarm.learner.poll() is None
    rows = [r for r in swarm.metrics() if r.get("step", 0) >= 1]
    assert all(math.isfinite(r["loss"]) for r in rows) and rows[-1]["train_steps_skipped_nonfinite"] == 0
    st = swarm.status()
    honest = [p for p in st["peers"] if p["groups_accepted"] > 0 and not p["banned"]]
    assert honest and all(r["rollouts_rejected_invalid"] == 0 for r in rows[-1:])
