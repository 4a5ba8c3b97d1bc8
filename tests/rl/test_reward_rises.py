"""One short end-to-end learning check (~30-60 s on 2 cores): synchronous GRPO on the warmed-up
default model raises the held-out sampled accuracy of addition. The full proof (400 steps,
S=0/S=4, 3 seeds, lr 0) is the CLI run reported in docs/rl-core-notes.md."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.mark.slow
def test_grpo_raises_eval_reward():
    import torch

    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import default_model
    from echorl.actor.types import RolloutGroup, SamplingParams
    from echorl.rl.buffer import StalenessBuffer
    from echorl.rl.grpo import GRPOConfig, GRPOTrainer
    from echorl.tasks import load_task

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model_dir = default_model()  # the shipped model (actor/default_model)
    task = load_task("addition", seed=0)
    trainer = GRPOTrainer(model_dir, GRPOConfig(lr=2e-4))
    actor = TorchBackend.from_pretrained(model_dir)
    evaluator = TorchBackend(trainer.model, actor.tokenizer)
    params = SamplingParams(max_new_tokens=task.max_new_tokens)
    ev = task.eval_prompts()
    ids = [evaluator.encode(p.text) for p in ev]

    def score() -> float:
        out = evaluator.sample_ids(ids, params, seed=1)
        return sum(task.reward(p, s.text) for p, s in zip(ev, out)) / len(ev)

    start = score()
    assert 0.1 < start < 0.6  # warm-up: clearly above zero, far from one
    buf = StalenessBuffer(0, scorer=task.reward)
    for step in range(60):
        prompts = buf.next_prompts(task, 16)
        out = actor.generate([p.text for p in prompts], 8, params, seed=step)
        for p, samples in zip(prompts, out):
            buf.offer(RolloutGroup(p.prompt_id, p.text, actor.encode(p.text), samples, actor.version), trainer.version)
        trainer.train_step(buf.take(16, trainer.version))
        actor.load_state_dict(trainer.state_dict(), trainer.version)
    end = score()
    print(f"eval_reward {start:.3f} -> {end:.3f}")
    assert end >= start + 0.05, (start, end)
