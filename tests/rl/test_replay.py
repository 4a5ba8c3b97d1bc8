"""Episodes end to end without a network: rollouts with a real (untrained) tiny model, replay
verification (honest transcripts pass; a forged observation, reward, mask or boundary is
refused), the service's ``env_mismatch`` answer counted against the peer, and the masked loss
(observation tokens never move it)."""

from __future__ import annotations

import copy
import os
import secrets
import time

import pytest
import torch
import trio

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from echorl.actor.backend import TorchBackend
from echorl.actor.episodes import run_episodes
from echorl.actor.model import TinyArch, build_char_tokenizer, make_model
from echorl.actor.types import RolloutGroup, Sample, SamplingParams
from echorl.rl.buffer import StalenessBuffer, Verdict
from echorl.rl.replay import ReplayBudget, Replayer, ReplayMismatch, ReplayOverBudget, episode_spec, group_scorer
from echorl.tasks import load_task


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    return TorchBackend(make_model(tok, TinyArch(), seed=0), tok)


def _episodes(backend, task, n_prompts=4, g=4, seed=1):
    prompts = task.next_prompts(n_prompts)
    _, groups = run_episodes(
        backend, task, [p.meta["env_seed"] for p in prompts], g, SamplingParams(), task.max_episode_tokens, seed=seed
    )
    return prompts, [RolloutGroup(p.prompt_id, p.text, backend.encode(p.text), s, 0) for p, s in zip(prompts, groups)]


def _with_observation(groups):
    return next(s for g in groups for s in g.samples if not all(s.mask))


def test_honest_episodes_replay_to_their_rewards(backend):
    for name in ("guess", "poker"):
        task = load_task(name)
        prompts, groups = _episodes(backend, task)
        rp = Replayer(task, backend.tokenizer)
        for p, g in zip(prompts, groups):
            assert rp.group(p, g) == [s.reward for s in g.samples]
            for s in g.samples:
                assert s.mask[0] and len(s.mask) == len(s.token_ids)
                assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.mask) if not m)


def test_forged_observation_reward_mask_or_boundary_is_refused(backend):
    task = load_task("guess")
    prompts, groups = _episodes(backend, task, n_prompts=8)
    rp = Replayer(task, backend.tokenizer)
    by_id = {p.prompt_id: p for p in prompts}
    s = _with_observation(groups)
    prompt = by_id[next(g.prompt_id for g in groups if s in g.samples)]
    i = s.mask.index(False)  # first observation token ('<', '>' or '!')
    other = backend.encode("<" if backend.tokenizer.decode([s.token_ids[i]]) != "<" else ">")[0]
    forgeries = {
        "observation": dict(token_ids=s.token_ids[:i] + [other] + s.token_ids[i + 1 :]),
        "reward": dict(reward=(s.reward or 0.0) + 1.0),
        "mask": dict(mask=[True] * len(s.mask)),
        "no mask": dict(mask=None),
        "truncated": dict(token_ids=s.token_ids[: i + 1], logprobs=s.logprobs[: i + 1], mask=s.mask[: i + 1]),
        "padded": dict(token_ids=s.token_ids + [s.token_ids[0]], logprobs=s.logprobs + [-1.0], mask=s.mask + [True]),
    }
    assert rp.episode(prompt, s) == s.reward
    for what, change in forgeries.items():
        fields = {
            "token_ids": s.token_ids,
            "logprobs": s.logprobs,
            "finish_reason": s.finish_reason,
            "text": s.text,
            "mask": s.mask,
            "reward": s.reward,
            **change,
        }
        with pytest.raises(ReplayMismatch):
            rp.episode(prompt, Sample(**fields))
            pytest.fail(f"forged {what} accepted")


def test_buffer_refuses_a_forged_group_and_requeues_its_prompt(backend):
    task = load_task("guess")
    buf = StalenessBuffer(2, group_scorer=group_scorer(task, backend.tokenizer))
    prompts = buf.next_prompts(task, 2)
    _, raw = run_episodes(backend, task, [p.meta["env_seed"] for p in prompts], 3, SamplingParams(), 2048, seed=5)
    good = RolloutGroup(prompts[0].prompt_id, prompts[0].text, backend.encode(prompts[0].text), raw[0], 0)
    bad_samples = [copy.deepcopy(x) for x in raw[1]]
    bad_samples[0].reward = 5.0
    bad = RolloutGroup(prompts[1].prompt_id, prompts[1].text, backend.encode(prompts[1].text), bad_samples, 0)
    assert buf.offer(good, 0) == Verdict.ACCEPTED and good.rewards == [x.reward for x in raw[0]]
    assert buf.offer(bad, 0) == Verdict.REJECTED_INVALID
    assert [p.prompt_id for p in buf.next_prompts(task, 1)] == [prompts[1].prompt_id]


def test_turn_limit_and_environment_error_episodes_replay(backend, monkeypatch):
    import sys
    import types

    from echorl.tasks import Environment, EnvStep

    class Raises(Environment):
        name, max_turns, max_action_tokens = "raises", 6, 1

        def reset(self, seed: int) -> str:
            return "R:"

        def step(self, action: str) -> EnvStep:
            if action == "" or ord(action[0]) % 3 == 0:
                raise RuntimeError("bad action")
            return EnvStep(done=False, reward=0.25, observation="+")

    mod = types.ModuleType("replay_envs")
    mod.Raises = Raises
    monkeypatch.setitem(sys.modules, "replay_envs", mod)
    for task in (load_task("guess", max_turns=2), load_task("replay_envs:Raises")):
        prompts, groups = _episodes(backend, task, n_prompts=6, g=4, seed=3)
        rp = Replayer(task, backend.tokenizer)
        finishes = {s.finish_reason for g in groups for s in g.samples}
        for p, g in zip(prompts, groups):
            assert rp.group(p, g) == [s.reward for s in g.samples]
        if task.name == "guess":
            assert "length" in finishes  # some episodes hit the 2-turn limit
        else:
            assert any(s.reward == 0.0 for g in groups for s in g.samples)  # ended by the error


def _trainer_loss(groups):
    from echorl.rl.grpo import GRPOConfig, GRPOTrainer

    tok = build_char_tokenizer()
    trainer = GRPOTrainer(make_model(tok, TinyArch(), seed=0), GRPOConfig(lr=0.0, max_grad_norm=None))
    return trainer.train_step(groups)["loss"]


def test_observation_tokens_never_move_the_loss():
    tok = build_char_tokenizer()
    enc = lambda t: tok(t, add_special_tokens=False)["input_ids"]

    def group(obs_tail: str, obs_logp: float, masked: bool = True) -> RolloutGroup:
        samples = []
        for action, r in (("1", 1.0), ("0", -1.0)):
            ids = enc(action + "<=" + action + obs_tail)
            mask = [True, False, False, True] + [False] * len(enc(obs_tail))
            lps = [-2.0 if m else obs_logp for m in mask]
            samples.append(Sample(ids, lps, "stop", "", mask=mask if masked else None, reward=r))
        return RolloutGroup("g", "K1:=", enc("K1:="), samples, 0, rewards=[1.0, -1.0])

    base = _trainer_loss([group("<=", 0.0)])
    assert _trainer_loss([group(">=", 0.0)]) == pytest.approx(base, abs=1e-7)  # other trailing observation
    assert _trainer_loss([group("<=", -7.0)]) == pytest.approx(base, abs=1e-7)  # other observation log-probs
    assert _trainer_loss([group("<=<=<=", 0.0)]) == pytest.approx(base, abs=1e-7)  # a longer observation
    assert _trainer_loss([group("<=", -7.0, masked=False)]) != pytest.approx(base, abs=1e-4)  # unmasked: it would


def _episode_service(backend):
    """A learner service for the guess task with one joined node; ``submit(forge)`` leases one
    prompt to it and returns its signed submission of two real episodes (``forge``: each claims a
    reward 1 higher than it earned)."""
    from echorl.learner.config import ServiceFields
    from echorl.learner.service import LearnerService, PeerRecord
    from echorl.net.host import RequestContext
    from echorl.protocol import wire
    from echorl.protocol.identity import Identity
    from echorl.protocol.messages import Capability, Submit
    from echorl.protocol.messages import RolloutGroup as WireGroup
    from echorl.protocol.messages import Sample as WireSample

    task = load_task("guess")
    buf = StalenessBuffer(4, group_scorer=group_scorer(task, backend.tokenizer))
    svc = LearnerService(
        Identity.generate(),
        "run-1",
        task,
        backend.tokenizer,
        buf,
        ServiceFields(group_size=2),
        vocab_size=len(backend.tokenizer),
    )
    node = Identity.generate()
    cap = Capability(
        engine="torch",
        device="cpu",
        memory_bytes=0,
        tokens_per_s=1.0,
        price_per_hour=0.0,
        reachable=True,
        listen_addrs=[],
    )
    svc.peers.add(PeerRecord(node.peer_id, cap, time.monotonic(), time.monotonic(), version=0))

    def submit(forge: bool) -> Submit:
        prompts = buf.next_prompts(task, 1)
        assert episode_spec(task, prompts[0]).seed == prompts[0].meta["env_seed"]
        rec = svc.leases.issue(node.peer_id, prompts, 2, 0, time.monotonic(), 60)
        _, eps = run_episodes(backend, task, [prompts[0].meta["env_seed"]], 2, SamplingParams(), 2048, seed=9)
        samples = [
            WireSample(
                token_ids=s.token_ids,
                logprobs=[min(0.0, x) for x in s.logprobs],
                finish_reason="stop",
                reward_hint=s.reward + (1.0 if forge else 0.0),
                model_mask=s.mask,
            )
            for s in eps[0]
        ]
        msg = Submit(
            run_id="run-1",
            lease_id=rec.lease_id,
            peer_id=node.peer_id,
            behaviour_version=0,
            groups=[WireGroup(prompt_id=prompts[0].prompt_id, samples=samples)],
            generate_seconds=0.1,
            nonce=secrets.token_bytes(16),
        )
        return wire.decode(wire.encode(wire.sign(msg, node)))

    return svc, buf, node, submit, RequestContext(node.peer_id, "/echorl/submit", time.time())


def test_service_answers_env_mismatch_and_counts_it_against_the_peer(backend):
    from echorl.protocol.errors import ErrorCode, ProtocolError

    svc, buf, node, submit, ctx = _episode_service(backend)

    async def main() -> None:
        ok = await svc.on_submit(submit(False), ctx)
        assert ok.accepted == 1
        with pytest.raises(ProtocolError) as err:
            await svc.on_submit(submit(True), ctx)
        assert err.value.code == ErrorCode.ENV_MISMATCH

    trio.run(main)
    assert svc.counters["rollouts_rejected_env"] == 1 and svc.peers.mismatches == {node.peer_id: 1}
    assert svc.counters["peers_flagged"] == 1 and not svc.leases.active
    assert len(buf) == 0 and svc.counters["groups_purged"] == 1  # convicted: its waiting group is not trained on


class Ticking:
    """A fake CPU clock: each read is ``step`` seconds after the last (no wall clock involved)."""

    def __init__(self, step: float = 1.0) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_replay_stops_once_its_cpu_budget_is_spent(backend):
    """The budget is read before each turn, on the clock it is given, for all the episodes of one
    submission together: an honest multi-turn episode passes within a budget that covers its
    turns and stops with ``ReplayOverBudget`` (not a mismatch) within one that does not."""
    task = load_task("guess")
    prompts, groups = _episodes(backend, task)
    k, g = next((k, g) for k, g in enumerate(groups) if any(not all(s.mask) for s in g.samples))
    turns = sum(1 + sum(1 for a, b in zip(s.mask, s.mask[1:]) if a and not b) for s in g.samples)
    rp = Replayer(task, backend.tokenizer)
    assert rp.group(prompts[k], g, ReplayBudget(turns, Ticking())) == [s.reward for s in g.samples]
    with pytest.raises(ReplayOverBudget, match="budget of 1 CPU s"):
        rp.group(prompts[k], g, ReplayBudget(1.0, Ticking()))
    assert not issubclass(ReplayOverBudget, ReplayMismatch)


def test_a_submission_whose_replay_spends_its_budget_is_refused_unverifiable_and_requeued(backend):
    """Past its CPU budget the replay stops and the submission is refused ``unverifiable``: the
    lease is settled, its prompt goes back to the queue, nothing is counted against the peer."""
    from echorl.protocol.errors import ErrorCode, ProtocolError

    svc, buf, node, submit, ctx = _episode_service(backend)
    svc.checks.replay_budget_s, svc.checks.replay_clock = 0.5, Ticking()  # every second read is over

    async def main() -> None:
        with pytest.raises(ProtocolError) as err:
            await svc.on_submit(submit(False), ctx)
        assert err.value.code == ErrorCode.UNVERIFIABLE

    trio.run(main)
    assert svc.counters["submissions_rejected_unverifiable"] == 1 and svc.counters["submissions_accepted"] == 0
    assert svc.peers.mismatches == {} and svc.counters["peers_flagged"] == 0
    assert not svc.leases.active and len(buf.requeued) == 1 and len(buf) == 0


def test_a_turn_is_checked_with_a_bounded_number_of_decodes(backend):
    """Where a turn may end is checked in ~log2(n) decodes, not one per token (a 2,000-token turn
    with stop strings was ~2,000 decodes of growing prefixes: issue 24); the first stop string is
    still found exactly."""
    task = load_task("guess")
    rp = Replayer(task, backend.tokenizer)
    rp.turn_tokens, rp.stop = 4000, ["STOP"]
    decodes = [0]
    plain = rp._decode

    def counted(ids):
        decodes[0] += 1
        return plain(ids)

    rp._decode = counted
    honest = backend.encode("a" * 1995 + "STOP")
    assert rp.action(honest, 0) == "a" * 1995 and decodes[0] <= 3
    decodes[0] = 0
    goes_on = backend.encode("b" * 700 + "STOP" + "c" * 1200)
    with pytest.raises(ReplayMismatch, match="ended at token 704"):
        rp.action(goes_on, 0)
    assert decodes[0] <= 16
