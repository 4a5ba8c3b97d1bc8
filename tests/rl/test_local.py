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


def test_an_actor_samples_its_lease_by_the_lease_seed_whichever_actor_serves_it():
    """train-local's actors sample as a network node samples a lease (``actor/seeded.py``): the
    lease's seed, not the actor's own, decides the tokens (completions and episodes alike), and
    the seed is derived from the run's seed, the version and the lease id."""
    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import default_model
    from echorl.actor.seeded import derived_seed
    from echorl.actor.types import SamplingParams
    from echorl.actor.worker import Lease, _rollouts
    from echorl.tasks import load_task
    from echorl.tasks.env import env_options_of, is_episodic

    def tokens(groups):
        return [[list(s.token_ids) for s in g] for g in groups]

    backend = TorchBackend.from_pretrained(default_model())
    seed = derived_seed(3, 0, 7)
    assert 0 <= seed < 2**63 and seed == derived_seed(3, 0, 7)
    assert len({seed, derived_seed(4, 0, 7), derived_seed(3, 1, 7), derived_seed(3, 0, 8)}) == 4
    for name in ("addition", "poker"):
        task = load_task(name, seed=0)
        prompts = task.next_prompts(4)
        params = SamplingParams(temperature=1.0, max_new_tokens=task.max_new_tokens)
        env = (name, env_options_of(task)) if is_episodic(task) else None
        lease = Lease(7, prompts, 4, params, 0, env, seed)
        by_actor = [tokens(_rollouts(backend, lease, {}, actor_seed)) for actor_seed in (300, 301)]
        assert by_actor[0] == by_actor[1], name
        unseeded = Lease(7, prompts, 4, params, 0, env)
        assert tokens(_rollouts(backend, unseeded, {}, 300)) != tokens(_rollouts(backend, unseeded, {}, 301))
        if env is None:  # the engine's own seeded samples of the lease (what the learner replays)
            texts = [p.text for p in prompts]
            assert by_actor[0] == tokens(backend.generate(texts, 4, params, sampling_seed=seed))


def test_a_run_repeats_its_metrics_whichever_and_however_many_actors_serve_it(tmp_path):
    """At --staleness 0 every lease's version is fixed, so with seeded leases one actor and two
    (which take the leases in whatever order they race for them) train on the same samples: the
    same rows, up to the float rounding of summing a batch whose groups arrived in another order."""
    from echorl.actor.model import default_model

    rows = {}
    for actors in (1, 2):
        metrics = tmp_path / f"m{actors}.jsonl"
        r = _cli(
            *("--model", str(default_model()), "--staleness", "0", "--actors", str(actors), "--seed", "5"),
            *("--prompts-per-step", "4", "--group-size", "4", "--lease-prompts", "2", "--eval-every", "2"),
            *("--actor-delay", "0", "--task-option", "n_eval=16", "--steps", "3", "--device", "cpu", "--quiet"),
            *("--metrics-out", str(metrics), "--work-dir", str(tmp_path / f"work{actors}")),
        )
        assert r.returncode == 0, r.stderr
        rows[actors] = [json.loads(line) for line in metrics.read_text().splitlines()]
    timing = {"busy_fraction", "rollouts_per_s"}
    assert [r["step"] for r in rows[2]] == [0, 1, 2, 3]
    assert any(r["reward_mean"] for r in rows[1][1:])  # the shipped model earns reward: tokens show
    for one, two in zip(rows[1], rows[2], strict=True):
        keys = {k for k in one if k not in timing and not k.endswith(("_s", "_seconds"))}
        assert keys == {k for k in two if k not in timing and not k.endswith(("_s", "_seconds"))}
        for k in keys:
            if isinstance(one[k], float):
                assert two[k] == pytest.approx(one[k], rel=1e-5, abs=1e-7), (one["step"], k)
            else:
                assert two[k] == one[k], (one["step"], k)
