"""A joined, correctly signing node sends rollouts that are valid on the wire but hostile in
meaning; each is refused (or made harmless) in process, against the real ``LearnerService``, the
real GRPO step and the tiny default model, while an honest submission is still accepted.

Findings covered (docs/threat-model.md): extreme / non-finite behaviour log-probs (NaN weights),
empty completions (the learner crashed), tokens after EOS / a stop string (trained on), a claimed
behaviour version never published (spot check dodged), a flagged peer whose check cannot run,
``generate_seconds = 5e-324`` (status unanswerable)."""

from __future__ import annotations

import math
import time

import pytest
import trio
from pydantic import ValidationError
from swarm import signed_submit

from echorl.learner.config import ServiceFields
from echorl.learner.service import LearnerService, PeerRecord
from echorl.net.host import RequestContext
from echorl.protocol import routes, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Capability, Lease, LeaseRequest, Sample, SamplingSpec, SubmitAccepted
from echorl.rl.buffer import StalenessBuffer

RUN = "echorl-demo"


@pytest.fixture(scope="module")
def tiny():
    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import build_default_model

    return TorchBackend.from_pretrained(build_default_model(warmup=None))


def _service(tiny, version=lambda: 0, spot=None, **policy) -> LearnerService:
    from echorl.tasks import load_task

    task = load_task("addition", digits=2, seed=0)
    kw = {"group_size": 2, "prompts_per_lease": 2, "prompts_per_step": 2, "staleness": 2, **policy}
    pol = ServiceFields(**kw)
    svc = LearnerService(
        Identity.generate(),
        RUN,
        task,
        tiny.tokenizer,
        StalenessBuffer(2, scorer=task.reward),
        pol,
        int(tiny.model.config.vocab_size),
        version=version,
        spot=spot,
    )
    return svc


def _join(svc: LearnerService, me: Identity, tokens_per_s: float = 1.0) -> RequestContext:
    cap = Capability(
        engine="torch",
        device="cpu",
        memory_bytes=0,
        tokens_per_s=tokens_per_s,
        price_per_hour=0.0,
        reachable=True,
        listen_addrs=[],
    )
    now = time.monotonic()
    svc.peers.add(PeerRecord(me.peer_id, cap, now, now, version=0))
    return RequestContext(peer_id=me.peer_id, protocol=routes.SUBMIT, received_at=time.time())


async def _lease(svc: LearnerService, ctx: RequestContext) -> Lease:
    reply = await svc.on_lease(LeaseRequest(run_id=RUN, version=svc.published, max_prompts=2), ctx)
    assert isinstance(reply, Lease), reply
    return reply


async def _code(coro) -> str:
    try:
        reply = await coro
    except ProtocolError as exc:
        return exc.code.value
    assert isinstance(reply, SubmitAccepted)
    return "ok"


def test_extreme_logprobs_are_refused_at_the_wire() -> None:
    with pytest.raises(ValidationError):
        Sample(token_ids=[4], logprobs=[-1e300], finish_reason="length", reward_hint=0.0)
    with pytest.raises(ValidationError):
        Sample(token_ids=[4], logprobs=[-100.5], finish_reason="length", reward_hint=0.0)
    with pytest.raises(ValidationError):  # an empty completion
        Sample(token_ids=[], logprobs=[], finish_reason="length", reward_hint=0.0)
    Sample(token_ids=[4], logprobs=[-100.0], finish_reason="length", reward_hint=0.0)  # the floor itself is fine
    # what a foreign client would put on the wire, bypassing the model: refused by the decoder
    me = Identity.generate()
    lease = Lease(
        lease_id="L1",
        run_id=RUN,
        prompts=[{"prompt_id": "p", "text": "1+1="}],
        group_size=1,
        sampling=SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=5, stop=[]),
        min_version=0,
        deadline_s=10.0,
    )
    msg = signed_submit(me, lease, 0, token_ids=(4,), logprobs=(-1.0,))
    body = bytearray(wire.encode(msg))
    pos = body.find(b"\xcb\xbf\xf0\x00\x00\x00\x00\x00\x00")  # msgpack float64 -1.0
    assert pos > 0
    body[pos + 1 : pos + 9] = bytes.fromhex("fe3c9e7d1f2a4c3b")  # a finite float64 ≈ -1e300
    with pytest.raises(ProtocolError) as err:
        wire.decode(bytes(body))
    assert err.value.code == ErrorCode.SCHEMA


def test_behaviour_logprob_far_below_the_policy_cannot_poison_the_weights(tiny) -> None:
    """−80 passes the wire (≥ −100) and is 80 nats below the policy: before the log-ratio clamp
    ``exp`` overflowed float32 and AdamW wrote NaN into every parameter."""
    import copy

    import torch

    from echorl.actor.types import RolloutGroup
    from echorl.actor.types import Sample as ActorSample
    from echorl.rl.grpo import GRPOConfig, GRPOTrainer, grpo_token_loss

    logp = torch.full((1, 3), -2.0, requires_grad=True)
    loss, _ = grpo_token_loss(logp, torch.full((1, 3), -100.0), torch.tensor([-1.0]), torch.ones(1, 3), GRPOConfig())
    loss.backward()
    assert math.isfinite(float(loss.detach())) and bool(torch.isfinite(logp.grad).all())

    trainer = GRPOTrainer(copy.deepcopy(tiny.model), GRPOConfig(lr=1e-2))
    ids = tiny.encode("1+1=")
    samples = [ActorSample([4, 5], [-100.0, -100.0], "length", "12"), ActorSample([4], [-0.5], "length", "1")]
    group = RolloutGroup("p0", "1+1=", ids, samples, 0, rewards=[0.0, 1.0])
    m = trainer.train_step([group])
    assert m["version"] == 1 and math.isfinite(m["loss"])
    assert trainer.weights_finite()


def test_nonfinite_step_is_skipped_and_empty_batch_dropped(tiny) -> None:
    import copy

    from echorl.actor.types import RolloutGroup
    from echorl.actor.types import Sample as ActorSample
    from echorl.rl.grpo import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(copy.deepcopy(tiny.model), GRPOConfig(lr=1e-2))
    ids = tiny.encode("1+1=")
    nan = [ActorSample([4], [float("nan")], "length", "1"), ActorSample([5], [-1.0], "length", "2")]
    m = trainer.train_step([RolloutGroup("p0", "1+1=", ids, nan, 0, rewards=[0.0, 1.0])])
    assert m["skipped"] == "nonfinite" and trainer.version == 0 and trainer.weights_finite()
    empty = [ActorSample([], [], "length", ""), ActorSample([], [], "length", "")]
    m = trainer.train_step([RolloutGroup("p1", "1+1=", ids, empty, 0, rewards=[0.0, 1.0])])
    assert m["skipped"] == "empty" and trainer.version == 0


def test_hostile_submissions_are_refused_and_an_honest_one_accepted(tiny) -> None:
    async def main() -> None:
        clock = [0]  # the learner's version t, as the training loop would report it
        svc = _service(tiny, version=lambda: clock[0])
        svc.note_published(0)
        bad, good = Identity.generate(), Identity.generate()
        bctx, gctx = _join(svc, bad), _join(svc, good)
        out = {}
        lease = await _lease(svc, bctx)
        # claims the learner's current-but-unpublished version 1 (t − b ≤ S holds): never checkable
        clock[0] = 1
        out["unpublished"] = await _code(
            svc.on_submit(signed_submit(bad, lease, 1, token_ids=(4,), logprobs=(-1.0,)), bctx)
        )
        lease = await _lease(svc, bctx)
        out["after_eos"] = await _code(
            svc.on_submit(signed_submit(bad, lease, 0, token_ids=(4, 1, 5), logprobs=(-1.0, -1.0, -1.0)), bctx)
        )
        lease = await _lease(svc, gctx)
        honest = signed_submit(good, lease, 0, token_ids=(4, 1), logprobs=(-1.0, -2.0))
        honest = wire.sign(honest.model_copy(update={"generate_seconds": 5e-324}), good)  # the tiny-time attack
        out["honest_ending_in_eos"] = await _code(svc.on_submit(honest, gctx))
        assert out == {"unpublished": "unpublished_version", "after_eos": "bad_rollout", "honest_ending_in_eos": "ok"}
        assert svc.counters["submissions_rejected_unpublished"] == 1 and svc.counters["rollouts_rejected_bad"] == 1
        assert len(svc.buffer) == 2  # only the honest groups
        st = svc.status()  # answerable: no derived rate is infinite
        row = next(p for p in st.peers if p["peer_id"] == good.peer_id)
        assert math.isfinite(row["rollouts_per_s"])

    trio.run(main)


def test_stop_string_must_end_the_completion(tiny) -> None:
    from echorl.learner.admission import Admission

    tok = tiny.tokenizer
    ids = tok("12", add_special_tokens=False)["input_ids"]  # "1", "2"
    kw = dict(max_new_tokens=5, vocab_size=99, eos_ids={1}, tokenizer=tok)
    Admission.check_completion(ids, stop=["2"], **kw)  # the stop string completes with the last token
    with pytest.raises(ProtocolError) as err:
        Admission.check_completion(ids + ids, stop=["2"], **kw)
    assert err.value.code == ErrorCode.BAD_ROLLOUT
    with pytest.raises(ProtocolError):
        Admission.check_completion([4] * 6, stop=[], **kw)  # longer than the lease allows


def test_submission_whose_check_cannot_run_is_refused(tiny) -> None:
    """Issue 24, finding 6: a skipped spot check was an accepted submission for an unflagged
    peer (claim the version being built, dodge the check); now every peer is refused, the lease
    re-queued, and the peer not counted against."""
    from echorl.learner.spot_check import SpotChecker

    async def main() -> None:
        svc = _service(tiny, spot=SpotChecker(tiny.model, tiny.tokenizer, 1.0, 0.0, lambda v: None))  # no snapshot held
        svc.note_published(0)
        me, other = Identity.generate(), Identity.generate()
        ctx, octx = _join(svc, me), _join(svc, other)
        svc.peers.flag(me.peer_id)
        lease = await _lease(svc, ctx)
        code = await _code(svc.on_submit(signed_submit(me, lease, 0, token_ids=(4,), logprobs=(-1.0,)), ctx))
        assert code == "unverifiable" and svc.counters["submissions_rejected_unverifiable"] == 1
        svc.police.spot.fraction = 1.0  # the unflagged peer's check is due too
        lease = await _lease(svc, octx)  # an unflagged peer is refused too, not counted against
        code = await _code(svc.on_submit(signed_submit(other, lease, 0, token_ids=(4,), logprobs=(-1.0,)), octx))
        assert code == "unverifiable" and svc.counters["submissions_rejected_unverifiable"] == 2
        assert other.peer_id not in svc.peers.flagged and not svc.leases.active and len(svc.buffer) == 0
        assert {p.prompt_id for p in lease.prompts} <= {p.prompt_id for p in svc.buffer.pending_prompts()}

    trio.run(main)


def test_nonfinite_step_flags_its_contributors(tiny) -> None:
    from echorl.learner.spot_check import SpotChecker

    async def main() -> None:
        svc = _service(tiny, spot=SpotChecker(tiny.model, tiny.tokenizer, 1.0, 0.0, lambda v: None))
        svc.note_published(0)
        me = Identity.generate()
        ctx = _join(svc, me)
        lease = await _lease(svc, ctx)
        assert await _code(svc.on_submit(signed_submit(me, lease, 0, token_ids=(4,), logprobs=(-1.0,)), ctx)) == "ok"
        batch = svc.buffer.take(2, 0)
        svc.step_skipped(batch, "nonfinite")
        assert me.peer_id in svc.peers.flagged

    trio.run(main)
