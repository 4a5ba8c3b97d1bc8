"""Mixed precision: a learner in bf16 mode keeps fp32 master weights and AdamW state, so its
updates at a small learning rate follow the fp32 learner's; versions are published in bf16."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from echorl.actor.types import RolloutGroup, SamplingParams
from echorl.rl.grpo import GRPOConfig, GRPOTrainer

LR = 1e-6  # where bf16 weights lose nearly every update (|lr·u| < |w|/256)
STEPS = 5
MIN_COSINE = 0.99


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from echorl.actor.model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("m") / "tiny", seed=0, warmup=None)


def _groups(model_dir) -> list[RolloutGroup]:
    from echorl.actor.backend import TorchBackend

    backend = TorchBackend.from_pretrained(model_dir)
    prompts = ["12+34=", "5+6=", "70+8=", "9+91="]
    out = backend.generate(prompts, 4, SamplingParams(max_new_tokens=6), seed=5)
    return [
        RolloutGroup(p, p, backend.encode(p), samples, 0, [float(i % 2) + 0.5 * (i == 0) for i in range(len(samples))])
        for p, samples in zip(prompts, out)
    ]


def _update(model_dir, groups: list[RolloutGroup], dtype: str) -> tuple[torch.Tensor, GRPOTrainer]:
    """The master weights' change over ``STEPS`` steps on ``groups`` (one flat fp64 vector)."""
    torch.manual_seed(0)
    trainer = GRPOTrainer(model_dir, GRPOConfig(lr=LR, dtype=dtype))
    before = [p.detach().double().clone() for p in trainer.model.parameters()]
    for _ in range(STEPS):
        trainer.train_step(groups)
    after = [p.detach().double() for p in trainer.model.parameters()]
    return torch.cat([(a - b).flatten() for a, b in zip(after, before)]), trainer


def test_bf16_learner_keeps_its_updates(tiny_model_dir):
    groups = _groups(tiny_model_dir)
    ref, _ = _update(tiny_model_dir, groups, "float32")
    got, trainer = _update(tiny_model_dir, groups, "bfloat16")
    cosine = float(torch.nn.functional.cosine_similarity(got, ref, dim=0))
    assert cosine >= MIN_COSINE, cosine
    # master weights and AdamW moments stay fp32; every RMSNorm gain moved, as in fp32
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    moments = [t for s in trainer.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert moments and all(t.dtype == torch.float32 for t in moments)
    norms = [p for n, p in trainer.model.named_parameters() if "norm" in n]
    assert norms and all(not torch.equal(p.detach(), torch.ones_like(p)) for p in norms)
    # the nodes get bf16 copies; a checkpoint keeps the fp32 master weights
    published = trainer.published_state()
    assert all(t.dtype == torch.bfloat16 for t in published.values() if t.is_floating_point())
    assert all(t.dtype == torch.float32 for t in trainer.state_dict().values() if t.is_floating_point())
