"""Seeded sampling and its replay (actor/seeded.py, learner/spot_check.py, the ``sampled`` row).

The noise is an integer hash any device reproduces; Gumbel-max over it draws from softmax(z/T)
with top-p; the torch engine samples by it from a lease's seed; the learner's one prefill finds
every honest token to be the seeded choice and refuses tokens that are not (one EOS with its
true log-prob, another temperature, ordinary unseeded sampling); the refusal flags the peer and
expires its other leases, and an honest checked submission's receipt says ``verified``.
"""

from __future__ import annotations

import random
import time

import pytest
import trio
from swarm import capability

from echorl.learner.config import ServiceFields
from echorl.learner.service import LearnerService, PeerRecord
from echorl.net.host import RequestContext
from echorl.protocol import routes, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Lease, LeaseRequest, SubmitAccepted
from echorl.rl.buffer import StalenessBuffer

RUN = "echorl-demo"


@pytest.fixture(scope="module")
def tiny():
    import torch

    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import build_default_model

    torch.set_num_threads(1)
    return TorchBackend.from_pretrained(build_default_model(warmup=None))


# --- the noise ---------------------------------------------------------------------------------
def test_noise_is_the_integer_hash_bit_for_bit() -> None:
    """The tensor path equals the plain-integer definition (what another engine implements)."""
    import torch

    from echorl.actor.seeded import GOLDEN, MASK32, _mix_int, gumbel, mix32, row_key, uniforms

    rng = random.Random(0)
    keys = [row_key(rng.getrandbits(63), rng.randrange(64), rng.randrange(4096)) for _ in range(16)]
    vocab = 300
    bits = mix32(torch.tensor(keys)[:, None] ^ ((torch.arange(vocab) * GOLDEN) & MASK32))
    expected = [[_mix_int(k ^ ((v * GOLDEN) & MASK32)) for v in range(vocab)] for k in keys]
    assert bits.tolist() == expected
    u = ((torch.tensor(expected) >> 9).float() + 0.5) / 2**23
    assert torch.equal(gumbel(keys, vocab), -torch.log(-torch.log(u)))
    extremes = uniforms(torch.tensor([0, MASK32]))  # every hash value is a finite draw
    assert extremes[0] > 0 and extremes[1] < 1 and torch.isfinite(-torch.log(-torch.log(extremes))).all()
    assert row_key(1, 2, 3) != row_key(1, 3, 2) != row_key(2, 2, 3)  # each input matters
    assert row_key(1, 2, 3) == 1972686339  # pinned: a change of the rule is a protocol change


def test_gumbel_max_draws_from_the_tempered_nucleus() -> None:
    import torch

    from echorl.actor.seeded import SeededRows

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, -3.0])
    n, temp = 20_000, 0.8
    rows = SeededRows(7, list(range(n)), [0] * n)
    picks = rows.choose(logits.expand(n, -1), 0, temp, 1.0)
    freq = torch.bincount(picks, minlength=5).double() / n
    assert torch.allclose(freq, torch.softmax(logits.double() / temp, -1), atol=0.012)
    nucleus = rows.choose(logits.expand(n, -1), 0, 1.0, 0.7)  # p = .64 .24 .09 ...: the top two
    assert set(nucleus.tolist()) == {0, 1}


def test_vllm_logits_processor_forces_the_seeded_choice() -> None:
    """The processor written for vLLM (not run inside vLLM here) leaves only the token the torch
    sampler picks at the same (sample, position)."""
    import torch

    from echorl.actor.seeded import SeededRows, VLLMSeededProcessor

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    rows = SeededRows(11, [3], [0], 6)
    proc = VLLMSeededProcessor(11, 3, 1.0, 0.9)
    for t in range(6):
        out = proc(list(range(t)), logits[t])
        assert torch.isfinite(out).sum() == 1
        assert int(out.argmax()) == int(rows.choose(logits[t : t + 1], t, 1.0, 0.9)[0])


# --- the engine and the replay -----------------------------------------------------------------
def _groups(backend, prompts, params, sampling_seed=None, seed=1):
    from echorl.actor.types import RolloutGroup as Group

    out = backend.generate([p.text for p in prompts], 4, params, seed=seed, sampling_seed=sampling_seed)
    return [Group(p.prompt_id, p.text, backend.encode(p.text), g, 0) for p, g in zip(prompts, out)]


def _proof(prompts, seed, top_p=1.0):
    from echorl.learner.spot_check import SeedProof

    return SeedProof(seed, top_p, {p.prompt_id: k for k, p in enumerate(prompts)}, 4)


@pytest.fixture(scope="module")
def setup(tiny):
    from echorl.actor.types import SamplingParams
    from echorl.learner.spot_check import SpotChecker
    from echorl.protocol import snapshot
    from echorl.tasks import load_task

    prompts = load_task("addition", digits=2, seed=0).next_prompts(6)
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    snaps = {0: snapshot.state_dict_to_safetensors(tiny.model.state_dict())}
    return prompts, params, SpotChecker(tiny.model, tiny.tokenizer, 1.0, 1.0, snaps.get)


def test_seeded_engine_is_reproducible_and_replays_exactly(tiny, setup) -> None:
    prompts, params, checker = setup
    a = _groups(tiny, prompts, params, sampling_seed=123, seed=1)
    b = _groups(tiny, prompts, params, sampling_seed=123, seed=2)  # the private RNG plays no part
    c = _groups(tiny, prompts, params, sampling_seed=124)
    tokens = [[s.token_ids for s in g.samples] for g in a]
    assert tokens == [[s.token_ids for s in g.samples] for g in b]
    assert tokens != [[s.token_ids for s in g.samples] for g in c]
    res = checker.check_sync(a, 0, proof=_proof(prompts, 123))
    n = sum(len(s.token_ids) for g in a for s in g.samples)
    assert res.ok and res.sampled and res.replayed == n and res.misses == 0 and res.max_gap < 1e-3


def _with_true_logprobs(tiny, groups, token_ids):
    """Every sample replaced by ``token_ids`` with the log-probs the model really gives them
    (what a cheater computes with one prefill: the log-prob spot check passes)."""
    import torch

    from echorl.actor.types import RolloutGroup as Group
    from echorl.actor.types import Sample

    out = []
    for g in groups:
        ids = torch.tensor([g.prompt_token_ids + list(token_ids)])
        with torch.inference_mode():
            logp = torch.log_softmax(tiny.model(input_ids=ids).logits[0, :-1].float(), -1)
        start = len(g.prompt_token_ids) - 1
        lps = [float(logp[start + i, t]) for i, t in enumerate(token_ids)]
        sample = Sample(list(token_ids), lps, "stop", "")
        out.append(Group(g.prompt_id, g.prompt_text, g.prompt_token_ids, [sample] * len(g.samples), 0))
    return out


def test_tokens_that_are_not_the_seeded_samples_are_caught(tiny, setup) -> None:
    from dataclasses import replace

    prompts, params, checker = setup
    proof = _proof(prompts, 123)
    eos = _with_true_logprobs(tiny, _groups(tiny, prompts, params, 123), [tiny.tokenizer.eos_token_id])
    unseeded = _groups(tiny, prompts, params, sampling_seed=None)  # today's sampler: right law, wrong noise
    cold = _groups(tiny, prompts, replace(params, temperature=0.7), sampling_seed=123)
    for name, groups in {"all_eos": eos, "unseeded": unseeded, "temperature_0.7": cold}.items():
        res = checker.check_sync(groups, 0, proof=proof)
        assert not res.sampled and res.misses > 0, name
    assert checker.check_sync(eos, 0, proof=proof).ok  # the log-prob check alone passes it


# --- the service -------------------------------------------------------------------------------
def _service(tiny, spot, **policy) -> LearnerService:
    from echorl.tasks import load_task

    task = load_task("addition", digits=2, seed=0)
    pol = ServiceFields(group_size=4, prompts_per_lease=2, prompts_per_step=8, staleness=4, **policy)
    buffer = StalenessBuffer(2, scorer=task.reward)
    return LearnerService(
        Identity.generate(), RUN, task, tiny.tokenizer, buffer, pol, int(tiny.model.config.vocab_size), spot=spot
    )


def _join(svc: LearnerService, me: Identity) -> RequestContext:
    now = time.monotonic()
    svc.peers.add(PeerRecord(me.peer_id, capability(), now, now, version=0))
    return RequestContext(peer_id=me.peer_id, protocol=routes.SUBMIT, received_at=time.time())


def _submit(me: Identity, lease: Lease, groups):
    import secrets

    from echorl.protocol.messages import RolloutGroup, Sample, Submit

    wire_groups = [
        RolloutGroup(
            prompt_id=p.prompt_id,
            samples=[
                Sample(
                    token_ids=s.token_ids,
                    logprobs=[min(0.0, x) for x in s.logprobs],
                    finish_reason="stop",
                    reward_hint=0.0,
                )
                for s in g
            ],
        )
        for p, g in zip(lease.prompts, groups)
    ]
    msg = Submit(
        run_id=RUN,
        lease_id=lease.lease_id,
        peer_id=me.peer_id,
        behaviour_version=0,
        groups=wire_groups,
        generate_seconds=0.1,
        nonce=secrets.token_bytes(16),
    )
    return wire.sign(msg, me)


def test_learner_refuses_unsampled_work_flags_and_marks_receipts(tiny, setup) -> None:
    from echorl.actor.types import SamplingParams

    _, _, checker = setup

    async def main() -> None:
        svc = _service(tiny, checker)
        svc.note_published(0)
        good, bad = Identity.generate(), Identity.generate()
        gctx, bctx = _join(svc, good), _join(svc, bad)

        async def lease(ctx):
            reply = await svc.on_lease(LeaseRequest(run_id=RUN, version=0, max_prompts=2), ctx)
            assert isinstance(reply, Lease) and reply.sampling_seed is not None
            return reply

        sp = svc.sampling
        params = SamplingParams(sp.temperature, sp.top_p, sp.max_new_tokens, list(sp.stop))
        honest = await lease(gctx)
        out = tiny.generate([p.text for p in honest.prompts], 4, params, sampling_seed=honest.sampling_seed)
        reply = await svc.on_submit(_submit(good, honest, out), gctx)
        assert isinstance(reply, SubmitAccepted) and reply.receipt is not None and reply.receipt.verified is True

        first = await lease(bctx)
        pending = svc.leases.issue(bad.peer_id, first.prompts, 4, 0, time.monotonic(), 60.0)  # a second one held
        from echorl.actor.types import RolloutGroup as Group

        base = [Group(p.prompt_id, p.text, tiny.encode(p.text), g, 0) for p, g in zip(first.prompts, out)]
        fake = [g.samples for g in _with_true_logprobs(tiny, base, [tiny.tokenizer.eos_token_id])]
        with pytest.raises(ProtocolError) as err:
            await svc.on_submit(_submit(bad, first, fake), bctx)
        assert err.value.code == ErrorCode.NOT_SAMPLED
        assert bad.peer_id in svc.peers.flagged and svc.counters["submissions_rejected_not_sampled"] == 1
        assert pending.lease_id not in svc.leases.active  # its other work is refused too
        with pytest.raises(ProtocolError) as err:
            await svc.on_submit(_submit(bad, first.model_copy(update={"lease_id": pending.lease_id}), fake), bctx)
        assert err.value.code == ErrorCode.UNKNOWN_LEASE

    trio.run(main)


def test_without_sampling_proofs_leases_carry_no_seed_and_unseeded_work_is_accepted(tiny, setup) -> None:
    """``--no-sampling-proofs`` (for vLLM nodes until their seeded processor is wired): no seed in
    the lease, log-probs still checked, unseeded samples accepted but their receipt not ``verified``."""
    from echorl.actor.types import SamplingParams

    _, _, checker = setup

    async def main() -> None:
        svc = _service(tiny, checker, sampling_proofs=False, spot_check_fraction=1.0)
        svc.note_published(0)
        node = Identity.generate()
        ctx = _join(svc, node)
        lease = await svc.on_lease(LeaseRequest(run_id=RUN, version=0, max_prompts=2), ctx)
        assert isinstance(lease, Lease) and lease.sampling_seed is None
        sp = svc.sampling
        out = tiny.generate([p.text for p in lease.prompts], 4, SamplingParams(sp.temperature, sp.top_p, 5, []))
        reply = await svc.on_submit(_submit(node, lease, out), ctx)
        assert isinstance(reply, SubmitAccepted) and reply.receipt is not None and reply.receipt.verified is False
        assert svc.police.metrics()["spot_checks"] >= 1 and node.peer_id not in svc.peers.flagged

    trio.run(main)


def test_episodes_are_seeded_so_oracle_play_fails_the_replay() -> None:
    """Poker with the shipped model (it answers digits): honest seeded episodes replay exactly; a
    node that keeps, for each deal, the best hands of re-rolled play (its own noise: what knowing
    the deal lets it pick) is caught."""
    from echorl.actor.backend import TorchBackend
    from echorl.actor.episodes import run_episodes
    from echorl.actor.model import default_model
    from echorl.actor.types import RolloutGroup as Group
    from echorl.actor.types import SamplingParams
    from echorl.learner.spot_check import SpotChecker
    from echorl.protocol import snapshot
    from echorl.tasks import load_task

    tiny = TorchBackend.from_pretrained(default_model())
    blob = snapshot.state_dict_to_safetensors(tiny.model.state_dict())
    checker = SpotChecker(tiny.model, tiny.tokenizer, 1.0, 1.0, lambda v: blob)
    task = load_task("poker", seed=0)
    prompts = task.next_prompts(4)
    seeds = [int(p.meta["env_seed"]) for p in prompts]
    params = SamplingParams(temperature=1.0, max_new_tokens=task.max_new_tokens)
    obs, honest = run_episodes(tiny, task, seeds, 4, params, task.max_episode_tokens, None, 99)
    groups = [Group(p.prompt_id, o, tiny.encode(o), g, 0) for p, o, g in zip(prompts, obs, honest)]
    proof = _proof(prompts, 99)
    res = checker.check_sync(groups, 0, proof=proof)
    assert res.ok and res.sampled and res.misses == 0 and res.replayed > 0
    best: list[list] = [[] for _ in prompts]  # the oracle: best of 8 re-rolls of each deal
    for reroll in range(8):
        _, out = run_episodes(tiny, task, seeds, 4, params, task.max_episode_tokens, reroll)
        for k, g in enumerate(out):
            best[k] = sorted(best[k] + g, key=lambda s: -float(s.reward or 0.0))[:4]
    assert sum(float(s.reward or 0.0) for g in best for s in g) > sum(float(s.reward or 0.0) for g in honest for s in g)
    oracle = [Group(p.prompt_id, o, tiny.encode(o), g, 0) for p, o, g in zip(prompts, obs, best)]
    res = checker.check_sync(oracle, 0, proof=proof)
    assert res.ok and not res.sampled  # its log-probs are true; its choices are not the lease's


def test_one_peer_fills_at_most_its_share_of_a_batch(tiny) -> None:
    """Batch of 8, max_batch_share 0.5: with another peer's 4 groups buffered, a peer that is
    leased more than 4 prompts has the groups beyond 4 of its own (half the buffer) refused entry
    (re-queued, unpaid); while the others have nothing buffered it is not bounded (an idle
    identity cannot stall it). A lease holds 1 or 2 prompts (sized to what the peer returns in the
    fleet's time, learner/pace.py), so the peer asks until it has been leased 5 or more."""
    from echorl.actor.types import SamplingParams

    async def run(other_leases: int) -> tuple[int, int, int]:
        svc = _service(tiny, None, max_batch_share=0.5)
        svc.note_published(0)
        sp = svc.sampling
        params = SamplingParams(sp.temperature, sp.top_p, sp.max_new_tokens, list(sp.stop))

        async def work(me: Identity, ctx: RequestContext) -> int:
            lease = await svc.on_lease(LeaseRequest(run_id=RUN, version=0, max_prompts=2), ctx)
            assert isinstance(lease, Lease)
            out = tiny.generate([p.text for p in lease.prompts], 4, params, sampling_seed=lease.sampling_seed)
            assert isinstance(await svc.on_submit(_submit(me, lease, out), ctx), SubmitAccepted)
            return len(lease.prompts)

        other, me = Identity.generate(), Identity.generate()
        octx, ctx = _join(svc, other), _join(svc, me)
        for _ in range(other_leases):
            await work(other, octx)
        leased = 0
        for _ in range(5):  # at least one prompt a lease: 5 leases always pass 4
            if leased > 4:
                break
            leased += await work(me, ctx)
        mine = sum(1 for pid in svc.buffer.buffered_ids() if svc.admission.contributors.get(pid) == me.peer_id)
        return mine, svc.counters["groups_over_batch_share"], len(svc.buffer.requeued)

    mine, over, requeued = trio.run(run, 2)
    assert mine == 4 and over == requeued >= 1
    alone = trio.run(run, 0)
    assert alone[0] > 4 and alone[1:] == (0, 0)  # nothing of others buffered: not bounded


def test_batch_share_does_not_bind_peers_of_equal_pace() -> None:
    """A buffer several batches deep (staleness) shared evenly by 3 peers: nobody is refused (a
    bound of half of one batch refused 61 % of the honest groups of a 3-node demo)."""
    from echorl.learner.admission import Admission
    from echorl.learner.config import AdmissionFields

    adm = Admission(policy=AdmissionFields(max_batch_share=0.5))
    peers = ["a", "b", "c"]
    buffered = [f"p{i}" for i in range(24)]
    for i, pid in enumerate(buffered):
        adm.note_contributor(pid, peers[i % 3])
    assert adm.batch_room("a", buffered, 8) == 8  # 8 held, 16 others: up to 16
    assert adm.batch_room("d", buffered, 8) == 24  # a newcomer may take up to half the buffer
    assert adm.batch_room("a", [p for i, p in enumerate(buffered) if i % 3 == 0], 8) > 8  # alone: unbounded
