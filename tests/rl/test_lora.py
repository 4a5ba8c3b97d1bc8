"""LoRA in the RL core (actor/lora.py): only the adapter trains, the base with the adapter
disabled is the KL reference, a version and a checkpoint are the adapter, resume restores it,
``echorl export`` merges it into a model directory transformers loads, a target the model
lacks or a base that differs is one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from echorl.actor import lora
from echorl.actor.backend import TorchBackend
from echorl.actor.model import default_model
from echorl.actor.types import RolloutGroup, SamplingParams
from echorl.rl.checkpoint import load_checkpoint, restore_trainer, save_checkpoint
from echorl.rl.config import TrainLocalConfig
from echorl.rl.grpo import GRPOConfig, GRPOTrainer

SETTINGS = lora.LoraSettings(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base() -> Path:
    return default_model()


@pytest.fixture(scope="module")
def batch(base):
    b = TorchBackend.from_pretrained(base)
    prompts = ["12+34=", "5+6=", "70+8="]
    out = b.generate(prompts, 4, SamplingParams(max_new_tokens=4), seed=0)
    return [
        RolloutGroup(f"p{i}", p, b.encode(p), s, 0, [float(j % 2) for j in range(4)])
        for i, (p, s) in enumerate(zip(prompts, out))
    ]


def _logp(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=ids).logits.float(), -1)


def test_only_the_adapter_trains_and_the_base_is_the_kl_reference(base, batch):
    tr = GRPOTrainer(base, GRPOConfig(lr=1e-2, kl_coef=0.5, lora=SETTINGS))
    assert tr.ref_model is None  # no second copy of the model
    in_optimizer = {id(p) for g in tr.optimizer.param_groups for p in g["params"]}
    adapter = {id(p) for n, p in tr.model.named_parameters() if "lora_" in n}
    assert in_optimizer == adapter and adapter
    base_before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if "lora_" not in n}
    version0 = tr.state_dict()
    assert set(version0) == set(lora.adapter_state(tr.model)) and all(".lora_" in k for k in version0)
    for _ in range(2):
        m = tr.train_step(batch)
    assert m["version"] == 2 and m["kl"] > 0  # the adapter moved away from the base
    for n, p in tr.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), n
    assert any(not torch.equal(version0[k], v) for k, v in tr.state_dict().items())
    # the reference is exactly the untouched base model
    ids = torch.tensor([batch[0].prompt_token_ids + batch[0].samples[0].token_ids])
    fresh = TorchBackend.from_pretrained(base).model
    with lora.reference(tr.model, None) as ref:
        assert torch.allclose(_logp(ref, ids), _logp(fresh, ids), atol=1e-6)
    assert not torch.allclose(_logp(tr.model, ids), _logp(fresh, ids), atol=1e-4)


def test_a_version_loads_into_an_engine_over_the_base(base, batch):
    tr = GRPOTrainer(base, GRPOConfig(lr=1e-2, lora=SETTINGS))
    tr.train_step(batch)
    engine = lora.adapt_backend(TorchBackend.from_pretrained(base), SETTINGS)
    engine.load_state_dict(tr.state_dict(), tr.version)
    ids = torch.tensor([batch[1].prompt_token_ids])
    assert engine.version == 1
    assert torch.allclose(_logp(engine.model, ids), _logp(tr.model.eval(), ids), atol=1e-6)
    wrong = {k: v[:-1] if k.endswith("lora_A.weight") else v for k, v in tr.state_dict().items()}
    with pytest.raises(lora.LoraError, match="shape"):
        engine.load_state_dict(wrong, 2)
    with pytest.raises(lora.LoraError, match="missing"):
        engine.load_state_dict(dict(list(tr.state_dict().items())[1:]), 2)
    plain = TorchBackend.from_pretrained(base)
    with pytest.raises(KeyError):  # an engine without the adapter refuses an adapter version
        plain.load_state_dict(tr.state_dict(), 1)


def test_checkpoint_holds_the_adapter_and_resumes(base, batch, tmp_path):
    a = GRPOTrainer(base, GRPOConfig(lr=1e-2, lora=SETTINGS))
    a.train_step(batch)
    path = save_checkpoint(tmp_path / "ck", a, 0)
    from safetensors.torch import load_file

    assert set(load_file(path / "model.safetensors")) == set(a.state_dict())
    ck = load_checkpoint(tmp_path / "ck")
    assert ck.base["lora"]["rank"] == 4 and ck.base["base_digest"] == lora.base_digest(base).hex()
    b = GRPOTrainer(base, GRPOConfig(lr=1e-2, lora=SETTINGS))
    restore_trainer(b, ck, rng=False)
    assert b.version == 1
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    a.train_step(batch)
    b.train_step(batch)  # same adapter, same optimizer moments: the same next step
    assert all(torch.allclose(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    with pytest.raises(lora.LoraError, match="same --lora-rank"):
        restore_trainer(GRPOTrainer(base, GRPOConfig()), ck, rng=False)


def test_missing_target_module_is_refused(base):
    model = TorchBackend.from_pretrained(base).model
    with pytest.raises(lora.LoraError, match="no linear module named qkv_proj"):
        lora.attach(model, lora.LoraSettings(4, 8.0, targets=("q_proj", "qkv_proj")))
    cfg = TrainLocalConfig(lora_rank=4, lora_targets=["qkv_proj"])
    with pytest.raises(ValueError, match="qkv_proj"):
        cfg.check_model()


def test_train_local_refuses_a_missing_target_in_one_line():
    r = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "train-local", "--lora-rank", "4", "--lora-target", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "no linear module named nope" in r.stderr


def test_base_digest_is_the_weights_not_the_files(base, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(base / "model.safetensors")
    names = sorted(tensors)
    (tmp_path / "a").mkdir()
    save_file({k: tensors[k] for k in names[:3]}, tmp_path / "a" / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in reversed(names[3:])}, tmp_path / "a" / "model-00002-of-00002.safetensors")
    assert lora.base_digest(tmp_path / "a") == lora.base_digest(base)  # sharding and order do not count
    changed = dict(tensors)
    changed[names[0]] = changed[names[0]].clone()
    changed[names[0]].view(-1)[0] += 1.0
    (tmp_path / "b").mkdir()
    save_file(changed, tmp_path / "b" / "model.safetensors")
    assert lora.base_digest(tmp_path / "b") != lora.base_digest(base)


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "echorl.cli", "export", *args], capture_output=True, text=True, timeout=300
    )


def test_export_merges_the_adapter_into_a_model_transformers_loads(base, batch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tr = GRPOTrainer(base, GRPOConfig(lr=1e-2, lora=SETTINGS))
    tr.train_step(batch)
    save_checkpoint(tmp_path / "ck", tr, 0)
    ids = torch.tensor([batch[2].prompt_token_ids + batch[2].samples[0].token_ids])
    want = _logp(tr.model.eval(), ids)

    r = _export("--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "merged"))
    assert r.returncode == 0, r.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert torch.allclose(_logp(merged, ids), want, atol=1e-5)
    assert TrainLocalConfig(model=str(tmp_path / "merged")).check_model() is None  # train-local --model takes it

    r = _export("--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "adapter"), "--adapter-only")
    assert r.returncode == 0, r.stderr
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    assert torch.allclose(_logp(peft, ids), want, atol=1e-5)

    r = _export("--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "x"), "--model", str(tmp_path / "merged"))
    assert r.returncode == 2 and "was trained on base model" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "x").exists()


def test_export_of_full_weights(base, batch, tmp_path):
    from transformers import AutoModelForCausalLM

    tr = GRPOTrainer(base, GRPOConfig(lr=1e-3))
    tr.train_step(batch)
    save_checkpoint(tmp_path / "ck", tr, 0)
    r = _export("--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "m"), "--adapter-only")
    assert r.returncode == 2 and "full weights" in r.stderr
    r = _export("--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    ids = torch.tensor([batch[0].prompt_token_ids])
    assert torch.allclose(_logp(AutoModelForCausalLM.from_pretrained(tmp_path / "m"), ids), _logp(tr.model.eval(), ids))


def test_the_demo_hands_its_lora_settings_to_the_learner():
    import argparse

    from echorl.cli.demo import DemoConfig
    from echorl.common import config
    from echorl.learner.config import LearnerConfig

    demo = DemoConfig(lora_rank=8, lora_alpha=4.0, lora_targets=["q_proj", "v_proj"], chat_template=False)
    p = argparse.ArgumentParser()
    config.add_arguments(p, LearnerConfig)
    learner = config.load(LearnerConfig, p.parse_args(demo.lora_flags()), "learner")
    assert learner.lora_settings() == demo.lora_settings() == lora.LoraSettings(8, 4.0, 0.0, ("q_proj", "v_proj"))
    assert learner.chat_template is False
    assert DemoConfig().lora_settings() is None  # full fine-tuning by default


def test_train_local_lease_timeout_is_a_setting():
    """A 135M model on a busy CPU takes minutes a lease: a fixed 2-minute timeout re-queued every
    lease before its answer came (and dropped the answer), so train-local never trained."""
    import argparse

    from echorl.common import config

    p = argparse.ArgumentParser()
    config.add_arguments(p, TrainLocalConfig)
    assert config.load(TrainLocalConfig, p.parse_args(["--lease-timeout", "900"]), "train-local").lease_timeout_s == 900
    assert TrainLocalConfig().lease_timeout_s == 120.0
