"""The one training loop (``rl/loop.py``), built by one builder (``rl/build.py``): the learner
peer and ``echorl train-local`` derive the same publication period κ, leasable version and
in-flight bound from their configurations (``rl/staleness.py``), both lease paths (the network
service, the actor source) apply them, and every training setting is a flag of both commands;
components refuse state they do not know; a checkpoint is assembled from the components and
restores each of them; evaluation is one fixed sample of the held-out set."""

from __future__ import annotations

import os
import queue
import time

import pytest
import trio

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from echorl.learner.config import LearnerConfig, ServiceFields
from echorl.learner.publish import Publisher
from echorl.learner.service import LearnerService, PeerRecord
from echorl.net.host import RequestContext
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Capability, Lease, LeaseDeferred, LeaseRequest
from echorl.rl import build, local
from echorl.rl.buffer import StalenessBuffer
from echorl.rl.config import TrainLocalConfig
from echorl.rl.loop import TrainingLoop
from echorl.rl.staleness import StalenessRule
from echorl.tasks import load_task


class _Version:
    """Stands in for GRPOTrainer where only the version is read."""

    def __init__(self, version: int = 0) -> None:
        self.version = version


def _loops(staleness: int, publish_every: int | None) -> tuple[TrainingLoop, TrainingLoop, _Version]:
    task = load_task("addition", digits=2, seed=0, n_eval=16)
    grpo = _Version()
    local_cfg = TrainLocalConfig(staleness=staleness, publish_every=publish_every or 0)
    local_loop = TrainingLoop(build.loop_settings(local_cfg), task, grpo, StalenessBuffer(staleness), None)
    cfg = LearnerConfig(staleness=staleness, publish_every=publish_every or 0)
    peer_loop = TrainingLoop(build.loop_settings(cfg), task, grpo, StalenessBuffer(staleness), None)
    return local_loop, peer_loop, grpo


@pytest.mark.parametrize("staleness", [0, 1, 2, 3, 4, 7])
@pytest.mark.parametrize("publish_every", [None, 1, 2, 5, 10])
def test_peer_and_train_local_compute_kappa_and_leasable_version_identically(staleness, publish_every):
    local_loop, peer_loop, grpo = _loops(staleness, publish_every)
    expected_kappa = max(1, min(publish_every or max(1, staleness - 1), max(1, staleness)))
    assert local_loop.kappa == peer_loop.kappa == expected_kappa
    policy = StalenessRule(staleness)
    lag = 0 if staleness <= 1 else 1
    for t in range(12):
        grpo.version = t
        for published in range(t + 1):
            want = max(0, min(published, t - staleness + lag))
            assert local_loop.min_version(published) == peer_loop.min_version(published) == want
            assert policy.min_version(t, published) == want


@pytest.mark.parametrize("staleness", [0, 1, 2, 3, 4, 7])
def test_both_lease_paths_bound_what_is_in_flight_alike(staleness):
    """One in-flight bound, B·max(1, S − lag): train-local's actor source leases up to it, the
    learner's lease policy caps a fresh node's room at it (train-local once used B or 2B)."""
    b = 4
    local_cfg = TrainLocalConfig(staleness=staleness, prompts_per_step=b)
    loop = TrainingLoop(build.loop_settings(local_cfg), load_task("addition", digits=2), _Version(9), None, None)
    source = local.ActorSource(local_cfg, loop, None, None)
    peer = StalenessRule(staleness, prompts_per_step=b)
    lag = 0 if staleness <= 1 else 1
    assert source.max_inflight == peer.in_flight_cap == peer.room(9, 9, 0) == b * max(1, staleness - lag)


def test_every_training_setting_is_a_flag_of_both_commands():
    """The learner reaches the GRPO, sampling and evaluation settings train-local has (it could
    not set kl_coef, loss_norm, off_policy_correction or top_p), through the one builder."""
    import argparse

    from echorl.common import config
    from echorl.rl.config import TrainingFields

    argv = ["--kl-coef", "0.1", "--loss-norm", "sequence", "--no-off-policy-correction", "--top-p", "1"]
    argv += ["--max-grad-norm", "0", "--micro-batch", "7", "--tis-cap", "3", "--weight-decay", "0.01"]
    argv += ["--adv-norm", "mean_std", "--kl-refresh", "10", "--entropy-coef", "0.5"]
    argv += ["--entropy-schedule", "cosine", "--entropy-final", "0.1"]
    for cls in (LearnerConfig, TrainLocalConfig):
        assert set(TrainingFields.model_fields) <= set(cls.model_fields), cls
        parser = argparse.ArgumentParser()
        config.add_arguments(parser, cls)
        cfg = config.load(cls, parser.parse_args(argv), "test")
        grpo = build.grpo_config(cfg, "cpu", "float32")
        assert (grpo.kl_coef, grpo.loss_norm, grpo.off_policy_correction) == (0.1, "sequence", False)
        assert (grpo.max_grad_norm, grpo.micro_batch, grpo.tis_cap, grpo.weight_decay) == (None, 7, 3.0, 0.01)
        assert grpo.adv_norm == "mean_std" and grpo.kl_refresh == 10
        assert (grpo.entropy_coef, grpo.entropy_schedule, grpo.entropy_final) == (0.5, "cosine", 0.1)
        task = load_task("addition", digits=2)
        assert TrainingLoop(build.loop_settings(cfg), task, _Version(), None, None).sampling_params().top_p == 1.0
        with pytest.raises(config.ConfigError, match="top_p < 1 is refused"):  # log-probs would not match
            config.load(cls, parser.parse_args(["--top-p", "0.9"]), "test")
        for bad in (["--kl-refresh", "5"], ["--kl-refresh", "5", "--kl-coef", "0.1", "--lora-rank", "4"]):
            with pytest.raises(config.ConfigError, match="--kl-refresh needs"):  # no reference, or a fixed one
                config.load(cls, parser.parse_args(bad), "test").check_task(task)


def _cap() -> Capability:
    return Capability(
        engine="torch",
        device="cpu",
        memory_bytes=0,
        tokens_per_s=1.0,
        price_per_hour=0.0,
        reachable=True,
        listen_addrs=[],
    )


@pytest.mark.parametrize("staleness", [1, 2, 4])
def test_both_lease_paths_issue_the_loops_min_version(staleness):
    """The network service and the actor source put the same oldest version on a lease."""
    local_loop, _, grpo = _loops(staleness, None)
    grpo.version, published = 9, 8
    want = local_loop.min_version(published)

    source = local.ActorSource(TrainLocalConfig(staleness=staleness), local_loop, None, None)
    source.published, source.lease_q = published, queue.Queue()
    source._lease_more()
    lease = source.lease_q.get_nowait()
    assert lease.min_version == want and lease.params.max_new_tokens == local_loop.task.max_new_tokens

    task = local_loop.task
    svc = LearnerService(
        Identity.generate(),
        "run-1",
        task,
        tokenizer=None,
        buffer=StalenessBuffer(staleness),
        settings=ServiceFields(staleness=staleness),
        vocab_size=100,
        version=lambda: grpo.version,
        published=published,
    )
    now = time.monotonic()
    svc.peers.add(PeerRecord("node", _cap(), now, now))

    svc.peers.add(PeerRecord("older", _cap(), now, now))  # one lease per new peer (admission)
    for v in range(want, published + 1):  # a learner with κ = 1 published (and holds) each of these
        svc.note_published(v)

    async def ask(version: int, peer: str = "node"):
        return await svc.on_lease(
            LeaseRequest(run_id="run-1", version=version, max_prompts=2), RequestContext(peer, "lease", now)
        )

    got = trio.run(ask, want)
    assert isinstance(got, Lease) and got.min_version == want
    if want > 0:
        too_old = trio.run(ask, want - 1, "older")
        # sent to the newest published version, not the oldest leased: see
        # test_weights_too_old_names_the_newest_published_version
        assert isinstance(too_old, LeaseDeferred) and too_old.want_version == published


def test_load_state_dict_refuses_unexpected_keys():
    task = load_task("addition", digits=2, seed=0, n_eval=16)
    buffer = StalenessBuffer(2)
    buffer.next_prompts(task, 3)
    buffer.rollouts_rejected_stale = 5
    saved = buffer.state_dict()
    fresh = StalenessBuffer(2)
    fresh.load_state_dict(saved)
    assert [p.prompt_id for p in fresh.pending_prompts()] == [p.prompt_id for p in buffer.pending_prompts()]
    assert fresh.rollouts_rejected_stale == 5

    loop = TrainingLoop(build.loop_settings(TrainLocalConfig()), task, _Version(), StalenessBuffer(2), None)
    publisher = Publisher(None, None)  # type: ignore[arg-type]
    parts = [
        (StalenessBuffer(2), saved, "buffer"),
        (loop, loop.state_dict(), "training loop"),
        (publisher, publisher.state_dict(), "publisher"),
    ]
    for part, good, owner in parts:
        with pytest.raises(ValueError, match=f"unexpected keys in {owner} state: \\['surprise'\\]"):
            part.load_state_dict({**good, "surprise": 1})
        with pytest.raises(ValueError, match="must be a dict"):
            part.load_state_dict([good])
    untouched = StalenessBuffer(2)
    with pytest.raises(ValueError, match="buffer counters"):
        untouched.load_state_dict({"pending": saved["pending"], "counters": {"nope": 1}})
    assert untouched.pending_prompts() == [] and untouched.rollouts_rejected_stale == 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from echorl.actor.model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("m") / "tiny", seed=0, warmup=None)


def _real_loop(tiny, tmp_path, **settings) -> TrainingLoop:
    from echorl.actor.backend import TorchBackend
    from echorl.rl.grpo import GRPOConfig, GRPOTrainer

    backend = TorchBackend.from_pretrained(tiny)
    task = load_task("addition", digits=2, seed=0, n_eval=16)
    s = build.loop_settings(TrainLocalConfig(staleness=2, checkpoint_dir=str(tmp_path / "ck"), seed=3))
    for k, v in settings.items():
        setattr(s, k, v)
    return TrainingLoop(s, task, GRPOTrainer(backend.model, GRPOConfig()), StalenessBuffer(2), backend)


def test_checkpoint_is_assembled_from_components_and_restores_each(tiny, tmp_path):
    class Part:
        def __init__(self) -> None:
            self.state = {"n": 0}

        def state_dict(self):
            return dict(self.state)

        def load_state_dict(self, state):
            self.state = dict(state)

    a = _real_loop(tiny, tmp_path)
    part = Part()
    part.state = {"n": 7}
    a.attach("service", part)
    a.buffer.next_prompts(a.task, 4)
    a.prompts_trained_twice, a.first_eval = 2, 0.25
    trio.run(a.checkpoint)

    b = _real_loop(tiny, tmp_path)
    assert b.resume()
    assert b.resumed_extra["task"] == "addition" and set(b.resumed_extra) >= {"loop", "buffer", "service"}
    assert b.task.cursor == a.task.cursor and len(b.buffer.pending_prompts()) == 4
    assert (b.prompts_trained_twice, b.first_eval) == (2, 0.25)
    late = Part()
    b.attach("service", late)  # attached after the resume: loads its saved state then
    assert late.state == {"n": 7}


def test_eval_is_one_fixed_sample_of_the_held_out_set(tiny, tmp_path):
    loop = _real_loop(tiny, tmp_path, eval_prompts=4)
    full1, full2, part = loop.evaluate(full=True), loop.evaluate(full=True), loop.evaluate(full=False)
    assert full1 == full2 and full1["eval_prompts"] == len(loop.task.eval_prompts()) == 16
    assert part["eval_prompts"] == 4
    # addition's eval_reward is exact (the expected accuracy), the one-sample figure stays beside it
    assert full1["eval_exact"] and 0.0 < full1["eval_reward"] < 1.0
    assert full1["eval_reward_sampled"] in {i / 16 for i in range(17)}


def test_a_version_the_learner_does_not_hold_is_deferred_to_its_newest():
    """After a resume the learner holds only what it published since; a node still at an older
    (in-window) version is told to update instead of being leased work that would be refused."""
    task = _loops(2, None)[0].task
    svc = LearnerService(
        Identity.generate(),
        "run-1",
        task,
        tokenizer=None,
        buffer=StalenessBuffer(2),
        settings=ServiceFields(staleness=2),
        vocab_size=100,
        version=lambda: 9,
        published=9,
    )
    svc.note_published(9)
    now = time.monotonic()
    svc.peers.add(PeerRecord("node", _cap(), now, now))

    async def ask(version: int):
        return await svc.on_lease(
            LeaseRequest(run_id="run-1", version=version, max_prompts=2), RequestContext("node", "lease", now)
        )

    got = trio.run(ask, 8)
    assert isinstance(got, LeaseDeferred) and got.reason == "weights_too_old" and got.want_version == 9
    ahead = trio.run(ask, 10)  # newer than anything published (held or not): unknown, not too old
    assert isinstance(ahead, LeaseDeferred) and ahead.reason == "weights_unknown" and ahead.want_version == 9
    assert isinstance(trio.run(ask, 9), Lease)
