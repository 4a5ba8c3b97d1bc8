"""GRPO: the loss and its gradient against a hand computation; trainer behaviour."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from echorl.actor.types import RolloutGroup, Sample
from echorl.rl.advantages import group_advantages
from echorl.rl.grpo import GRPOConfig, GRPOTrainer, grpo_token_loss, scheduled_entropy, scheduled_lr
from echorl.rl.schedules import anneal

# ratios per token; seq 0 has A=+1 (third token padded), seq 1 has A=-1
RATIOS = [[1.1, 1.5, 1.0], [3.0, 0.5, 1.0]]
MASK = [[1, 1, 0], [1, 1, 1]]
LB = -1.0


def _inputs():
    lb = torch.full((2, 3), LB, dtype=torch.float64)
    logp = (torch.log(torch.tensor(RATIOS, dtype=torch.float64)) + lb).requires_grad_(True)
    return logp, lb, torch.tensor([1.0, -1.0], dtype=torch.float64), torch.tensor(MASK)


def test_loss_and_gradient_token_norm_by_hand():
    # per token surrogate s and ds/dlogp (clip 0.2, tis cap 2):
    #  A=+1 r=1.1 -> s=1.1, grad 1.1         A=+1 r=1.5 -> clipped s=1.2, grad 0
    #  A=-1 r=3.0 -> truncated s=-2, grad -2  A=-1 r=0.5 -> clipped s=-0.8, grad 0
    #  A=-1 r=1.0 -> s=-1, grad -1           5 real tokens; loss = -sum(s)/5
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.2, tis_cap=2.0, loss_norm="token")
    logp, lb, adv, mask = _inputs()
    loss, stats = grpo_token_loss(logp, lb, adv, mask, cfg)
    assert float(loss.detach()) == pytest.approx(-(1.1 + 1.2 - 2.0 - 0.8 - 1.0) / 5, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[-1.1, 0.0, 0.0], [2.0, 0.0, 1.0]], dtype=torch.float64) / 5
    assert torch.allclose(logp.grad, expected, atol=1e-12)
    assert stats["clip_frac"] == pytest.approx(2 / 5) and stats["tis_frac"] == pytest.approx(1 / 5)


def test_without_off_policy_correction_the_behaviour_policy_is_ignored():
    # r = 1 everywhere (ratio to the current policy itself): loss -sum(A)/5 over real tokens,
    # gradient -A/5 on every real token: no clipping, no truncation, however stale pi_b is.
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.2, tis_cap=2.0, off_policy_correction=False)
    logp, lb, adv, mask = _inputs()
    loss, stats = grpo_token_loss(logp, lb, adv, mask, cfg)
    assert float(loss.detach()) == pytest.approx(-(1 + 1 - 1 - 1 - 1) / 5, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64) / 5
    assert torch.allclose(logp.grad, expected, atol=1e-12)
    assert stats["clip_frac"] == 0.0 and stats["tis_frac"] == 0.0 and stats["ratio_mean"] == pytest.approx(1.0)


def test_the_decoupled_correction_scales_mismatched_tokens_instead_of_masking_them():
    # weight w = min(pi/pi_b, 2) per token, surrogate w * A, gradient -w * A / 5:
    #  A=+1 r=1.1 -> w 1.1     A=+1 r=1.5 -> w 1.5 (the PPO clip against pi_b gave it no gradient)
    #  A=-1 r=3.0 -> w 2 (cap)  A=-1 r=0.5 -> w 0.5 (clipped to no gradient before)   A=-1 r=1 -> w 1
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.2, tis_cap=2.0, decoupled=True)
    logp, lb, adv, mask = _inputs()
    loss, stats = grpo_token_loss(logp, lb, adv, mask, cfg)
    assert float(loss.detach()) == pytest.approx(-(1.1 + 1.5 - 2.0 - 0.5 - 1.0) / 5, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[-1.1, -1.5, 0.0], [2.0, 0.5, 1.0]], dtype=torch.float64) / 5
    assert torch.allclose(logp.grad, expected, atol=1e-12)
    assert (
        stats["clip_frac"] == 0.0
        and stats["tis_frac"] == pytest.approx(1 / 5)
        and stats["ratio_mean"] == pytest.approx((1.1 + 1.5 + 3 + 0.5 + 1) / 5)
    )


def test_loss_and_gradient_sequence_norm_by_hand():
    cfg = GRPOConfig(loss_norm="sequence")
    logp, lb, adv, mask = _inputs()
    loss, _ = grpo_token_loss(logp, lb, adv, mask, cfg)
    seq0, seq1 = (1.1 + 1.2) / 2, (-2.0 - 0.8 - 1.0) / 3
    assert float(loss.detach()) == pytest.approx(-(seq0 + seq1) / 2, abs=1e-12)
    loss.backward()
    expected = torch.tensor([[-1.1 / 2, 0, 0], [2.0 / 3, 0, 1.0 / 3]], dtype=torch.float64) / 2
    assert torch.allclose(logp.grad, expected, atol=1e-12)


def test_kl_term_by_hand():
    # one token, A=0: only the k3 KL remains; ref - logp = ln 2
    cfg = GRPOConfig(kl_coef=0.5)
    logp = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.0 + math.log(2)]], dtype=torch.float64)
    loss, stats = grpo_token_loss(logp, logp.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1, 1), cfg, ref)
    assert float(loss.detach()) == pytest.approx(0.5 * (2 - math.log(2) - 1), abs=1e-12)
    loss.backward()
    assert float(logp.grad) == pytest.approx(0.5 * (1 - 2), abs=1e-12)  # d/dl [e^(r-l) - (r-l) - 1]


def test_group_advantages():
    assert group_advantages([1.0, 0.0, 0.0, 1.0], "mean_std", eps=0.0) == [1.0, -1.0, -1.0, 1.0]
    assert group_advantages([1.0, 1.0, 1.0], "mean_std") == [0.0, 0.0, 0.0]
    assert group_advantages([2.0, 0.0], "mean") == [1.0, -1.0]
    assert group_advantages([3.0, 0.0]) == [1.5, -1.5]  # the default keeps the chips at stake
    with pytest.raises(ValueError, match="mean_std"):
        group_advantages([1.0, 0.0], "std")  # type: ignore[arg-type]


def test_config_validation():
    with pytest.raises(ValueError, match="loss_norm"):
        GRPOConfig(loss_norm="batch")
    with pytest.raises(ValueError):
        GRPOConfig(tis_cap=0.5)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from echorl.actor.model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("m") / "tiny", seed=0, warmup=None)


def _groups(backend, version, rewards_fn):
    from echorl.actor.types import SamplingParams

    prompts = ["12+34=", "5+6="]
    out = backend.generate(prompts, 4, SamplingParams(max_new_tokens=4), seed=3)
    return [
        RolloutGroup(p, p, backend.encode(p), samples, version, [rewards_fn(i) for i in range(len(samples))])
        for p, samples in zip(prompts, out)
    ]


def test_trainer_matches_actor_logprobs_and_versions(tiny_model_dir):
    from echorl.actor.backend import TorchBackend

    backend = TorchBackend.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=1e-3, micro_batch=3))
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    m = trainer.train_step(_groups(backend, 0, lambda i: float(i % 2)))
    # actor (left-padded, KV cache) and learner (right-padded, full pass) agree on log-probs
    assert m["logp_abs_diff"] < 1e-4 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert trainer.version == 1 and m["version"] == 1 and m["sequences"] == 8
    after = trainer.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # publishing into the backend: in place, same parameter objects
    ptrs = [p.data_ptr() for p in backend.model.parameters()]
    backend.load_state_dict(after, trainer.version)
    assert backend.version == 1 and ptrs == [p.data_ptr() for p in backend.model.parameters()]
    assert all(torch.equal(backend.model.state_dict()[k], after[k]) for k in after)
    # the tied output matrix is not published twice, and the backend's stays tied to the embedding
    assert "lm_head.weight" not in after
    assert torch.equal(backend.model.get_output_embeddings().weight, after["model.embed_tokens.weight"])


def test_lr_zero_and_equal_rewards_leave_weights(tiny_model_dir):
    from echorl.actor.backend import TorchBackend

    backend = TorchBackend.from_pretrained(tiny_model_dir)
    for cfg, rewards in ((GRPOConfig(lr=0.0), lambda i: float(i % 2)), (GRPOConfig(lr=1e-2), lambda i: 1.0)):
        trainer = GRPOTrainer(tiny_model_dir, cfg)
        before = trainer.state_dict()
        m = trainer.train_step(_groups(backend, 0, rewards))
        assert trainer.version == 1
        after = trainer.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), cfg
        assert m["grad_norm"] == 0.0 or cfg.lr == 0.0


def test_an_entropy_bonus_is_in_the_loss_and_keeps_the_policy_wider(tiny_model_dir):
    """By hand: the loss falls by ``entropy_coef`` × the token-mean entropy. In training: from the
    same start and batches, the run with the bonus ends with a wider policy than the one without."""
    from echorl.actor.backend import TorchBackend

    logp, blogp, adv, mask = _inputs()
    entropy = torch.rand_like(logp)
    plain, _ = grpo_token_loss(logp, blogp, adv, mask, GRPOConfig())
    bonus, _ = grpo_token_loss(logp, blogp, adv, mask, GRPOConfig(entropy_coef=0.3), entropy=entropy)
    want = float(plain.detach()) - 0.3 * float((entropy * mask).sum() / mask.sum())
    assert float(bonus.detach()) == pytest.approx(want, rel=1e-6)

    # over two tokens only: the entropy of their renormalised pair (at most ln 2), with its gradient
    two = GRPOTrainer(tiny_model_dir, GRPOConfig(entropy_coef=0.1, entropy_tokens=(5, 9)))
    ids = torch.tensor([[4, 5, 9, 7]])
    _, full, pair = two.token_logprobs_entropy(two.model, ids, torch.ones_like(ids))
    q = torch.softmax(two.model(input_ids=ids).logits[:, :-1, [5, 9]].float(), -1)
    assert pair.requires_grad and torch.allclose(pair, -(q * q.log()).sum(-1), atol=1e-6)
    assert float(pair.detach().max()) <= math.log(2) + 1e-6 < float(full.min())

    backend = TorchBackend.from_pretrained(tiny_model_dir)
    groups = _groups(backend, 0, lambda i: float(i % 2))
    ends = {}
    for coef in (0.0, 1.0):
        trainer = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=3e-3, entropy_coef=coef))
        for _ in range(4):
            ends[coef] = trainer.train_step(groups)["entropy"]
    assert ends[1.0] > ends[0.0] + 0.01, ends


def test_train_step_rejects_missing_rewards(tiny_model_dir):
    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig())
    g = RolloutGroup("p", "1+1=", [4, 75, 4, 83], [Sample([5], [-1.0], "length", "2")], 0, None)
    with pytest.raises(ValueError, match="rewards missing"):
        trainer.train_step([g])


def test_train_step_rejects_out_of_range_tokens(tiny_model_dir):
    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig())
    g = RolloutGroup("p", "1+1=", [4, 75, 4, 83], [Sample([10**6], [-1.0], "length", "?")] * 2, 0, [0.0, 1.0])
    with pytest.raises(ValueError, match="out of range"):
        trainer.train_step([g])


def test_step_metrics_show_learning_health(tiny_model_dir):
    """grad_norm, entropy, zero_var_group_frac and clip_frac are in every step's metrics."""
    import math as m

    from echorl.actor.backend import TorchBackend

    backend = TorchBackend.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=1e-3))
    groups = _groups(backend, 0, lambda i: float(i % 2))
    groups[1].rewards = [1.0] * len(groups[1].samples)  # one group of equal rewards: no signal
    got = trainer.train_step(groups)
    assert got["zero_var_group_frac"] == 0.5 and got["grad_norm"] > 0 and got["clip_frac"] == 0.0
    vocab = int(trainer.model.config.vocab_size)
    assert 0.0 < got["entropy"] <= m.log(vocab) + 1e-6  # nats, at most uniform's


def test_cosine_schedule_falls_to_its_floor_and_the_optimizer_uses_it(tiny_model_dir):
    """Cosine from lr at step 0 to lr_min_ratio × lr at the last step (and after); constant or a
    one-step run stays at lr; the trainer sets each step's rate before stepping."""
    from echorl.actor.backend import TorchBackend

    cos = GRPOConfig(lr=1e-3, lr_schedule="cosine", lr_min_ratio=0.1, lr_steps=11)
    assert scheduled_lr(cos, 0) == pytest.approx(1e-3)
    assert scheduled_lr(cos, 5) == pytest.approx(0.55e-3)  # half-way: the mean of lr and the floor
    assert scheduled_lr(cos, 10) == pytest.approx(1e-4) == scheduled_lr(cos, 50)
    assert all(scheduled_lr(cos, k + 1) < scheduled_lr(cos, k) for k in range(10))
    assert scheduled_lr(GRPOConfig(lr=1e-3, lr_steps=11), 7) == 1e-3
    assert scheduled_lr(GRPOConfig(lr=1e-3, lr_schedule="cosine", lr_steps=1), 0) == 1e-3
    with pytest.raises(ValueError):
        GRPOConfig(lr_schedule="linear")  # type: ignore[arg-type]
    backend = TorchBackend.from_pretrained(tiny_model_dir)
    trainer = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=1e-3, lr_schedule="cosine", lr_min_ratio=0.1, lr_steps=3))
    used = []
    for _ in range(3):
        trainer.train_step(_groups(backend, 0, lambda i: float(i % 2)))
        used.append(trainer.optimizer.param_groups[0]["lr"])
    assert used == pytest.approx([1e-3, 0.55e-3, 1e-4])


def test_schedules_by_hand_and_the_entropy_weight_each_step_uses(tiny_model_dir):
    """``anneal``: start at step 0, end from the last step on, a line or half a cosine between;
    the trainer weighs the bonus of step k by the schedule at k (lr 0: the same weights every step,
    so the loss moves by exactly the weight's change × the bonus's entropy)."""
    from echorl.actor.backend import TorchBackend

    assert anneal("linear", 0.5, 0.1, 0, 5) == 0.5 and anneal("linear", 0.5, 0.1, 1, 5) == pytest.approx(0.4)
    assert anneal("cosine", 0.5, 0.1, 2, 5) == pytest.approx(0.3)  # half-way: the mean
    assert anneal("cosine", 0.5, 0.1, 1, 5) == pytest.approx(0.1 + 0.4 * (1 + math.cos(math.pi / 4)) / 2)
    assert anneal("linear", 0.5, 0.1, 4, 5) == pytest.approx(0.1) == anneal("cosine", 0.5, 0.1, 99, 5)
    assert anneal("constant", 0.5, 0.1, 3, 5) == 0.5 == anneal("cosine", 0.5, 0.1, 3, 0)  # no end: no schedule
    with pytest.raises(ValueError, match="schedule"):
        anneal("step", 1.0, 0.0, 0, 2)  # type: ignore[arg-type]
    cfg = GRPOConfig(entropy_coef=0.5, entropy_schedule="linear", entropy_final=0.1, lr_steps=5)
    assert [scheduled_entropy(cfg, k) for k in range(5)] == pytest.approx([0.5, 0.4, 0.3, 0.2, 0.1])
    assert scheduled_entropy(GRPOConfig(entropy_coef=0.5, entropy_final=0.1, lr_steps=5), 4) == 0.5

    backend = TorchBackend.from_pretrained(tiny_model_dir)
    groups = _groups(backend, 0, lambda i: float(i % 2))
    sched = GRPOConfig(lr=0.0, entropy_coef=1.0, entropy_schedule="linear", entropy_final=0.0, lr_steps=3)
    trainer = GRPOTrainer(tiny_model_dir, sched)
    m = [trainer.train_step(groups) for _ in range(3)]  # weights 1, 0.5, 0 (the bonus: vocabulary entropy)
    assert m[1]["loss"] - m[0]["loss"] == pytest.approx(0.5 * m[0]["entropy"], rel=1e-4)
    assert m[2]["loss"] - m[0]["loss"] == pytest.approx(1.0 * m[0]["entropy"], rel=1e-4)
    assert [x["entropy_coef"] for x in m] == pytest.approx([1.0, 0.5, 0.0])  # in each step's row


def test_the_kl_reference_follows_the_policy_every_kl_refresh_steps(tiny_model_dir):
    """The magnet moves: with ``kl_refresh=2`` the reference is the start model until step 2, then
    the policy of step 2 (the next step's KL starts at 0); without it, the start model throughout.
    A resumed run's magnet is the weights it resumes from."""
    from echorl.actor.backend import TorchBackend

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

    backend = TorchBackend.from_pretrained(tiny_model_dir)
    groups = _groups(backend, 0, lambda i: float(i % 2))
    fixed = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=1e-2, kl_coef=0.1))
    moving = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=1e-2, kl_coef=0.1, kl_refresh=2))
    start = copy.deepcopy(moving.model)
    kl = {}
    for step in (1, 2, 3):
        for name, trainer in (("fixed", fixed), ("moving", moving)):
            kl[name, step] = trainer.train_step(groups)["kl"]
        if step == 1:
            assert same(moving.ref_model, start) and not same(moving.ref_model, moving.model)
        if step == 2:
            assert same(moving.ref_model, moving.model) and not same(moving.ref_model, start)
            assert same(fixed.ref_model, start)
    assert kl["moving", 2] > 0 and kl["moving", 3] == pytest.approx(0.0, abs=1e-7)
    assert kl["fixed", 3] > kl["fixed", 2] > 0  # the fixed reference falls further behind
    resumed = GRPOTrainer(tiny_model_dir, GRPOConfig(lr=1e-2, kl_coef=0.1, kl_refresh=2))
    resumed.load_state(fixed.state_dict(), resumed.optimizer.state_dict(), 3)
    assert same(resumed.ref_model, fixed.model)
    with pytest.raises(ValueError, match="kl_refresh needs kl_coef"):
        GRPOConfig(kl_refresh=2)
