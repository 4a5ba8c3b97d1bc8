"""Checkpoint -> resume continues the same run: identical weights, optimizer, version, RNG,
data cursor and pending prompts; writes are atomic."""

from __future__ import annotations

import os
import random

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from echorl.actor.types import RolloutGroup, SamplingParams
from echorl.rl.checkpoint import has_checkpoint, load_checkpoint, restore_trainer, save_checkpoint
from echorl.rl.grpo import GRPOConfig, GRPOTrainer
from echorl.tasks import load_task


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from echorl.actor.model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("m") / "tiny", seed=1, warmup=None)


def _batches(model_dir, task, n):
    from echorl.actor.backend import TorchBackend

    b = TorchBackend.from_pretrained(model_dir)
    out = []
    for k in range(n):
        prompts = task.next_prompts(2)
        gen = b.generate([p.text for p in prompts], 4, SamplingParams(max_new_tokens=4), seed=k)
        out.append(
            [
                RolloutGroup(p.prompt_id, p.text, b.encode(p.text), s, k, [float(i % 2) for i in range(4)])
                for p, s in zip(prompts, gen)
            ]
        )
    return out


def test_checkpoint_resume_equality(model_dir, tmp_path):
    task = load_task("addition", seed=3)
    batches = _batches(model_dir, task, 3)
    cfg = GRPOConfig(lr=1e-3)
    a = GRPOTrainer(model_dir, cfg)
    a.train_step(batches[0])
    a.train_step(batches[1])
    pending = task.next_prompts(3)
    torch.manual_seed(123)
    random.seed(9)
    path = save_checkpoint(tmp_path / "ck", a, task.cursor, pending, extra={"run": "x"})
    assert path.name == "v00000002" and has_checkpoint(tmp_path / "ck")
    rng_a = (torch.rand(3), random.random())
    a.train_step(batches[2])

    b = GRPOTrainer(model_dir, cfg)
    ck = load_checkpoint(tmp_path / "ck")
    restore_trainer(b, ck)
    assert b.version == 2 and ck.extra == {"run": "x"} and ck.pending == pending
    rng_b = (torch.rand(3), random.random())
    assert torch.equal(rng_a[0], rng_b[0]) and rng_a[1] == rng_b[1]
    resumed_task = load_task("addition", seed=3)
    resumed_task.seek(ck.cursor)
    assert resumed_task.next_prompts(1)[0].prompt_id == f"addition:{task.cursor}"  # no repeats
    b.train_step(batches[2])
    assert b.version == a.version == 3
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    oa, ob = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert all(torch.equal(oa[i]["exp_avg_sq"], ob[i]["exp_avg_sq"]) for i in oa)


def test_atomic_layout_and_pruning(model_dir, tmp_path):
    t = GRPOTrainer(model_dir, GRPOConfig(lr=0.0))
    root = tmp_path / "ck"
    for v in range(4):
        t._version = v
        save_checkpoint(root, t, cursor=v, keep=2)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["LATEST", "v00000002", "v00000003"]  # no temporary leftovers
    assert load_checkpoint(root).cursor == 3
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "none")
