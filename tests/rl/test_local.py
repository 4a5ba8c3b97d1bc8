"""``echorl train-local``: argument errors are clear; a short real run with actor processes
writes the metrics contract and resumes from its checkpoint without repeating versions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _cli(*args, timeout=180):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "echorl.cli", "train-local", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--task", "additon"], "unknown task 'additon'"),
        (["--task", "addition", "--task-option", "digitz=3"], "unknown option(s) ['digitz']"),
        (["--model", "/nonexistent/dir"], "not a Hugging Face model directory"),
        (["--staleness", "-1"], "--staleness (staleness): Input should be greater than or equal to 0"),
        (["--actors", "0"], "--actors (actors): Input should be greater than or equal to 1"),
        (["--resume"], "--resume needs --checkpoint-dir"),
    ],
)
def test_bad_config_gives_clear_error(args, fragment):
    r = _cli(*args, timeout=60)
    assert r.returncode == 2 and fragment in r.stderr, r.stderr


KEYS = {
    "step",
    "version",
    "reward_mean",
    "eval_reward",
    "rollouts_accepted",
    "rollouts_rejected_stale",
    "staleness_max",
    "staleness_mean",
    "busy_fraction",
    "elapsed_s",
    "staleness_step_max",
}


def test_short_run_metrics_and_resume(tmp_path):
    from echorl.actor.model import build_default_model

    model = build_default_model(tmp_path / "tiny", seed=0, warmup=None)
    metrics, ck, work = tmp_path / "m.jsonl", tmp_path / "ck", tmp_path / "work"
    common = [
        "--model",
        str(model),
        "--staleness",
        "2",
        "--actors",
        "2",
        "--prompts-per-step",
        "4",
        "--group-size",
        "4",
        "--lease-prompts",
        "2",
        "--eval-every",
        "2",
        "--actor-delay",
        "0.05",
        "--metrics-out",
        str(metrics),
        "--checkpoint-dir",
        str(ck),
        "--task-option",
        "n_eval=16",
        "--work-dir",
        str(work),
    ]
    r = _cli("--steps", "3", "--device", "cpu", "--quiet", *common)
    assert r.returncode == 0, r.stderr
    assert "learner and actors on cpu, float32" in r.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(set(row) >= KEYS for row in rows)
    assert rows[0]["eval_reward"] is not None and rows[-1]["eval_reward"] is not None
    assert rows[0]["eval_exact"] and rows[0]["eval_reward_sampled"] is not None  # addition: exact eval
    assert all({"grad_norm", "entropy", "zero_var_group_frac", "clip_frac"} <= set(row) for row in rows[1:])
    # the actors run the learner's own fp32 code, at most 2 versions behind at lr 5e-4: a small mismatch
    assert all(0 <= row["behaviour_mismatch"] < 0.05 for row in rows[1:])
    assert rows[-1]["rollouts_accepted"] == 12
    assert all(0 <= row["staleness_max"] <= 2 for row in rows)
    assert "summary" in r.stderr and "train-local step" not in r.stderr
    # the work dir holds a version newer than the checkpoint (another run's): dropped, never loaded
    weights = work / "weights"
    newest = max(weights.glob("v*.safetensors"))
    shutil.copy(newest, weights / "v00000050.safetensors")
    r = _cli("--steps", "5", "--resume", *common)  # not --quiet, stderr a pipe: plain progress lines
    assert r.returncode == 0, r.stderr
    assert "train-local step 4/5" in r.stderr and "train-local step 5/5" in r.stderr and "\x1b[" not in r.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[-1]["rollouts_accepted"] == 20  # the buffer's counters continue across the resume
    assert rows[-1]["prompts_trained_twice"] == 0  # the loop's trained ids too
    state = json.loads((ck / (ck / "LATEST").read_text() / "state.json").read_text())
    assert state["version"] == 5
    assert {"loop", "buffer", "task", "seed"} <= set(state["extra"])  # assembled from the components
    assert len(state["extra"]["loop"]["trained_prompt_ids"]) == 20
    assert not (weights / "v00000050.safetensors").exists()


def test_publishing_a_version_drops_newer_ones_and_old_ones(tmp_path):
    """A version newer than the one published is another run's (a reused --work-dir after a
    resume): removed, so the actors never load it."""
    import torch

    from echorl.actor.worker import publish_weights, visible_versions

    state = {"w": torch.zeros(2)}
    for v in (1, 2, 3, 9, 10):
        publish_weights(tmp_path, state, v, keep=100)
    publish_weights(tmp_path, state, 4, keep=3)  # keeps 2..4
    assert [v for v, _ in visible_versions(tmp_path, 0.0)] == [4, 3, 2]
