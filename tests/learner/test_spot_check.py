"""Behaviour log-prob spot checks (architecture §3, learner/spot_check.py).

In process: a group sampled by the real TorchBackend from the tiny untrained model passes the
check against its own version; the same group with log-probs shifted by +0.3, or checked against
another version, fails; a version no longer held is skipped.

Real processes: a learner checking every submission refuses a foreign peer's signed submission
with fabricated log-probs (``logprob_mismatch``, nothing accepted, prompts re-queued), refuses
it leases after 3 mismatches, stays up, and a real node's submissions all pass while it trains.
"""

from __future__ import annotations

import copy
import json
import random
import secrets
import signal
import time

import pytest
import trio
from swarm import remote_code, signed_submit

from echorl.net.host import open_host
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
    Submit,
)


# --- in process -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sampled():
    """(backend, groups sampled at version 0, snapshots {0: v0, 1: one GRPO step later})."""
    import torch

    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import build_default_model
    from echorl.actor.types import RolloutGroup as Group
    from echorl.actor.types import SamplingParams
    from echorl.protocol import snapshot
    from echorl.rl.grpo import GRPOConfig, GRPOTrainer
    from echorl.tasks import load_task

    torch.manual_seed(0)
    backend = TorchBackend.from_pretrained(build_default_model(warmup=None))
    task = load_task("addition", digits=2, seed=0)
    prompts = task.next_prompts(4)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=task.max_new_tokens, stop=list(task.stop))
    out = backend.generate([p.text for p in prompts], 8, params, seed=1)
    groups = [Group(p.prompt_id, p.text, backend.encode(p.text), g, 0) for p, g in zip(prompts, out)]
    snaps = {0: snapshot.state_dict_to_safetensors(backend.model.state_dict())}
    rng = random.Random(0)  # an untrained model earns no reward: random ones make the step move
    for g in groups:
        g.rewards = [float(rng.random() < 0.5) for _ in g.samples]
    trainer = GRPOTrainer(copy.deepcopy(backend.model), GRPOConfig(lr=5e-4))
    trainer.train_step(groups)
    snaps[1] = snapshot.state_dict_to_safetensors(trainer.state_dict())
    return backend, groups, snaps


def _checker(backend, snaps, **kw):
    from echorl.learner.spot_check import SpotChecker

    return SpotChecker(backend.model, backend.tokenizer, 1.0, 1.0, snaps.get, **kw)


def _shifted(groups, delta):
    from echorl.actor.types import RolloutGroup as Group
    from echorl.actor.types import Sample as ASample

    return [
        Group(
            g.prompt_id,
            g.prompt_text,
            g.prompt_token_ids,
            [
                ASample(s.token_ids, [min(0.0, x + delta) for x in s.logprobs], s.finish_reason, s.text)
                for s in g.samples
            ],
            g.behaviour_version,
        )
        for g in groups
    ]


def test_honest_group_passes_forged_or_other_version_fails(sampled):
    backend, groups, snaps = sampled
    checker = _checker(backend, snaps)
    honest = trio.run(checker.check, groups, 0)
    assert honest.ok and not honest.skipped and honest.tokens > 0
    assert honest.mean_abs_diff < 1e-4 and honest.max_abs_diff < 1e-3
    shifted = trio.run(checker.check, _shifted(groups, 0.3), 0)
    assert not shifted.ok and shifted.mean_abs_diff > 0.2
    other = trio.run(checker.check, groups, 1)  # sampled at v0, claimed v1
    assert not other.ok and other.mean_abs_diff > checker.tolerance_mean
    again = trio.run(checker.check, groups, 0)  # switching back reloads v0
    assert again.ok
    gone = trio.run(checker.check, groups, 7)
    assert gone.ok and gone.skipped and gone.tokens == 0


def test_should_check_fraction_and_flags(sampled):
    backend, _, snaps = sampled
    none = _checker(backend, snaps)
    none.fraction = 0.0
    assert not any(none.should_check() for _ in range(100))
    assert none.should_check(flagged=True) and not none.should_check(flagged=False)
    some = _checker(backend, snaps, rng=random.Random(0))
    some.fraction = 0.25
    hits = sum(some.should_check() for _ in range(4000))
    assert 800 < hits < 1200


def test_template_model_is_a_separate_copy(sampled):
    backend, groups, snaps = sampled
    checker = _checker(backend, snaps)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    assert not trio.run(checker.check, groups, 1).ok  # loads v1 into the scratch copy only
    after = backend.model.state_dict()
    assert all(bool((before[k] == after[k]).all()) for k in before)


# --- real processes ---------------------------------------------------------------------------
CONFIG = {
    "prompts_per_step": 4,
    "prompts_per_lease": 4,
    "group_size": 4,
    "staleness": 1,
    "eval_every": 100000,
    "eval_prompts": 8,
    "steps": 0,
    "spot_check_fraction": 1.0,
}


def _forged(me: Identity, lease: Lease) -> Submit:
    return signed_submit(me, lease, 0, token_ids=(5, 6, 7), logprobs=(-0.05, -0.1, -0.02))


async def _join(host, learner: str, me: Identity) -> None:
    cap = Capability(
        engine="torch",
        device="cpu",
        memory_bytes=1,
        tokens_per_s=1.0,
        price_per_hour=0.0,
        reachable=True,
        listen_addrs=[host.addrs[0]],
    )
    join = JoinRequest(
        run_id="echorl-demo",
        peer_id=me.peer_id,
        capability=cap,
        version=0,
        timestamp=time.time(),
        nonce=secrets.token_bytes(16),
    )
    await host.request(learner, routes.JOIN, wire.sign(join, me), expect=JoinAccepted)


async def forge(addr: str, me: Identity | None = None) -> dict:
    me = me or Identity.generate()
    out: dict = {"codes": []}
    async with open_host(me) as host:
        learner = await host.connect(addr)
        status = lambda: host.request(learner, routes.STATUS, StatusRequest(), expect=Status)
        await _join(host, learner, me)
        lease_req = LeaseRequest(run_id="echorl-demo", version=0, max_prompts=4)
        for _ in range(3):
            lease = await host.request(learner, routes.LEASE, lease_req, expect=(Lease, LeaseDeferred))
            assert isinstance(lease, Lease), lease
            out["codes"].append(await remote_code(host.request(learner, routes.SUBMIT, _forged(me, lease))))
        out["lease_after_ban"] = await remote_code(host.request(learner, routes.LEASE, lease_req))
        st = await status()
        out["learner"] = dict(st.learner)
        out["me"] = next(dict(p) for p in st.peers if p["peer_id"] == me.peer_id)
        out["peer_id"] = me.peer_id
    return out


async def _status(addr: str) -> dict:
    async with open_host(Identity.generate()) as host:
        peer = await host.connect(addr)
        reply = await host.request(peer, routes.STATUS, StatusRequest(), expect=Status, timeout=20)
        return {"learner": dict(reply.learner), "peers": [dict(p) for p in reply.peers]}


def test_forged_logprobs_refused_and_honest_node_trains(swarm, tmp_path):
    cfg = tmp_path / "learner.json"
    cfg.write_text(json.dumps(CONFIG))
    addr = swarm.start_learner("--config", str(cfg))
    out = trio.run(forge, addr)
    assert out["codes"] == ["logprob_mismatch"] * 3
    assert out["lease_after_ban"] == "logprob_mismatch"  # refused leases after 3 mismatches
    lr = out["learner"]
    assert lr["submissions_accepted"] == 0 and lr["groups_received"] == 0 and lr["buffer"] == 0
    assert lr["rollouts_rejected_logprob"] == 3 and lr["spot_checks"] == 3
    assert lr["peers_flagged"] == 1 and lr["peers_banned"] == 1 and lr["leases_active"] == 0
    assert out["me"]["logprob_mismatches"] == 3 and out["me"]["banned"] is True
    assert swarm.learner.poll() is None

    swarm.start_node("honest")  # its re-queued prompts are trained; every submission checked
    swarm.wait_for(lambda: any(r.get("step", 0) >= 3 for r in swarm.metrics()), what="3 steps", timeout=90)
    st = trio.run(_status, addr)
    lr = st["learner"]
    assert lr["rollouts_rejected_logprob"] == 3  # the honest node's submissions all passed
    assert lr["spot_checks"] >= 6 and lr["spot_checks"] + lr["spot_checks_skipped"] >= 3 + lr["submissions_accepted"]
    node = next(p for p in st["peers"] if p["peer_id"] != out["peer_id"])
    # 3 steps of 4 groups came from it; a group whose 4 samples are the same tokens is trained but
    # not paid (it carries no signal), so paid + unpaid is what it delivered
    assert node["logprob_mismatches"] == 0 and node["groups_accepted"] >= 1
    assert node["groups_accepted"] + node["groups_dropped"] >= 12
    assert lr["spot_check_passed_max_abs_diff"] < 1e-3  # honest CPU numerics: far inside the tolerance
    row = [r for r in swarm.metrics() if r.get("step", 0) >= 3][-1]
    assert row["rollouts_rejected_logprob"] == 3 and row["spot_checks"] >= 6 and row["peers_banned"] == 1
    assert swarm.learner.poll() is None


async def rejoin_and_ask_lease(addr: str, me: Identity) -> tuple[str, dict]:
    async with open_host(me) as host:
        learner = await host.connect(addr)
        await _join(host, learner, me)
        code = await remote_code(
            host.request(learner, routes.LEASE, LeaseRequest(run_id="echorl-demo", version=0, max_prompts=4))
        )
        st = await host.request(learner, routes.STATUS, StatusRequest(), expect=Status)
        return code, next(dict(p) for p in st.peers if p["peer_id"] == me.peer_id)


def test_ban_survives_learner_restart(swarm, tmp_path):
    cfg = tmp_path / "learner.json"
    cfg.write_text(json.dumps(CONFIG))
    ckpt = ["--config", str(cfg), "--checkpoint-dir", str(tmp_path / "ckpt")]
    me = Identity.generate()
    out = trio.run(forge, swarm.start_learner(*ckpt, log="learner1.log"), me)
    assert out["lease_after_ban"] == "logprob_mismatch" and out["me"]["banned"] is True
    swarm.learner.send_signal(signal.SIGTERM)  # checkpoints on the way out
    assert swarm.learner.wait(timeout=60) == 0

    addr = swarm.start_learner(*ckpt, "--resume", log="learner2.log")
    code, me_status = trio.run(rejoin_and_ask_lease, addr, me)
    assert code == "logprob_mismatch"  # still banned by the restarted learner
    assert me_status["banned"] is True and me_status["logprob_mismatches"] == 3
    assert "restored spot-check flags of 1 peers (1 banned)" in swarm.learner_log.read_text()
