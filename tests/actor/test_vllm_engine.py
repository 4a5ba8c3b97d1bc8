"""The vLLM engine's adapter (``actor/vllm_backend.py``, ``actor/vllm_worker.py``) on the CPU, driven
by a stand-in ``vllm`` module (``fake_vllm.py``) that samples with a real torch model. What this
proves: sampling parameters are translated as documented, the sampled token's log-prob is the one
extracted (a spot check from the snapshot agrees), weight updates are checked, travel as a file to
the worker extension and land in place without a restart. What it cannot prove: that real vLLM
behaves as the stand-in does (``scripts/gpu-check.sh`` checks that on a GPU)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import fake_vllm

from echorl.actor.types import RolloutGroup, SamplingParams
from echorl.actor.vllm_backend import VLLMBackend, row_seed, sampling_kwargs, to_sample


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from echorl.actor.model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("m") / "tiny", seed=0, warmup=None)


@pytest.fixture
def engine(model_dir):
    return VLLMBackend(model_dir, 0.3, vllm_module=fake_vllm, dtype="float32", seed=1)


def _checker(backend, state_dict):
    """The learner's float32 spot checker over one snapshot (version 0)."""
    from echorl.learner.spot_check import SpotChecker
    from echorl.protocol.snapshot import state_dict_to_safetensors

    blob = state_dict_to_safetensors(state_dict)
    import copy

    return SpotChecker(copy.deepcopy(backend.llm.engine.model), backend.tokenizer, 1.0, 1.0, lambda v: blob)


def _groups(backend, prompts, samples):
    return [RolloutGroup(f"p{i}", p, backend.encode(p), s, 0) for i, (p, s) in enumerate(zip(prompts, samples))]


def test_sampling_params_translation():
    kw = sampling_kwargs(SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=9, stop=["\n"]), 4, 11)
    assert kw == {"n": 4, "temperature": 0.7, "top_p": 1.0, "max_tokens": 9, "stop": ["\n"], "logprobs": 0, "seed": 11}
    assert sampling_kwargs(SamplingParams(), 1, None)["stop"] is None
    with pytest.raises(ValueError, match="top_p"):  # vLLM's log-probs would be post-truncation
        sampling_kwargs(SamplingParams(temperature=1.0, top_p=0.9), 1, None)
    assert sampling_kwargs(SamplingParams(temperature=0.0, top_p=0.9), 1, None)["top_p"] == 0.9  # greedy: fine
    assert len({row_seed(5, i) for i in range(100)}) == 100 and row_seed(None, 3) is None


def test_logprob_extraction_picks_the_sampled_token():
    L, C = fake_vllm.Logprob, fake_vllm.CompletionOutput
    c = C(0, "ab", [7, 8], [{7: L(-0.5), 3: L(-0.1)}, {8: L(2e-7)}], "length")
    s = to_sample(c)
    assert s.token_ids == [7, 8] and s.logprobs == [-0.5, 0.0] and s.finish_reason == "length"
    with pytest.raises(RuntimeError, match="no log-prob"):
        to_sample(C(0, "a", [7], [{3: L(-0.1)}], "stop"))
    with pytest.raises(RuntimeError, match="steps"):
        to_sample(C(0, "a", [7], None, "stop"))
    with pytest.raises(RuntimeError, match="abort"):
        to_sample(C(0, "a", [7], [{7: L(-1.0)}], "abort"))


def test_engine_is_built_for_processed_logprobs_and_the_worker_extension(engine):
    kw = engine.llm.init_kwargs
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["worker_extension_cls"] == "echorl.actor.vllm_worker.EchoWorkerExtension"
    assert kw["dtype"] == "float32" and kw["gpu_memory_utilization"] == 0.3


def test_generate_logprobs_pass_the_learners_spot_check(engine):
    prompts = ["12+7=", "3+44=", "12+7="]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop=["\n"])
    groups = engine.generate(prompts, 4, params, seed=3)
    assert [len(g) for g in groups] == [4, 4, 4]
    assert [sp.n for sp in engine.llm.sampling] == [4, 4, 4]
    assert [sp.seed for sp in engine.llm.sampling] == [row_seed(3, i) for i in range(3)]
    assert all(s.token_ids and len(s.logprobs) == len(s.token_ids) for g in groups for s in g)
    res = _checker(engine, engine.llm.engine.model.state_dict()).check_sync(_groups(engine, prompts, groups), 0)
    assert res.ok and res.tokens > 20 and res.max_abs_diff < 1e-4


def test_sample_ids_gives_identical_rows_distinct_draws(engine):
    row = engine.encode("5+5=")
    out = engine.sample_ids([row] * 6, SamplingParams(temperature=1.0, max_new_tokens=6), seed=9)
    assert len(out) == 6 and all(sp.n == 1 for sp in engine.llm.sampling)
    assert len({tuple(s.token_ids) for s in out}) > 1  # per-row seeds: not six copies of one sample
    assert engine.sample_ids([], SamplingParams()) == []
    with pytest.raises(ValueError, match="empty prompt"):
        engine.sample_ids([[]], SamplingParams())


def test_multi_turn_episodes_run_on_the_engine(engine):
    from echorl.actor.episodes import run_episodes
    from echorl.tasks import load_task

    task = load_task("guess")
    prompts, groups = run_episodes(engine, task, [1, 2], 2, SamplingParams(temperature=1.0), 64, seed=4)
    assert len(prompts) == 2 and [len(g) for g in groups] == [2, 2]
    for s in (s for g in groups for s in g):
        assert s.mask is not None and any(s.mask) and s.reward is not None
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.mask) if not m)


def test_weights_update_in_place_and_sampling_follows(engine):
    import torch

    before = {k: v.clone() for k, v in engine.llm.engine.model.state_dict().items()}
    torch.manual_seed(0)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in before.items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]  # tied, as in a learner's snapshot
    built = fake_vllm.LLM.constructed
    engine.load_state_dict(new, 5)
    assert engine.version == 5 and fake_vllm.LLM.constructed == built  # no restart
    ((method, (path,)),) = engine.llm.rpcs
    assert method == "echorl_load_weights_file" and not os.path.exists(path)  # the file is gone afterwards
    assert engine.llm.prefix_resets == 1
    live = engine.llm.engine.model.state_dict()
    assert all(torch.equal(live[k], new[k]) for k in live if k != "lm_head.weight")

    prompts = ["21+30=", "8+8="]
    groups = engine.generate(prompts, 4, SamplingParams(temperature=1.0, max_new_tokens=6), seed=2)
    assert _checker(engine, new).check_sync(_groups(engine, prompts, groups), 0).ok
    assert not _checker(engine, before).check_sync(_groups(engine, prompts, groups), 0).ok


def test_bad_update_is_refused_before_the_engine_is_touched(engine):
    sd = dict(engine.llm.engine.model.state_dict())
    name = next(k for k in sd if k.endswith("q_proj.weight"))
    with pytest.raises(KeyError, match="missing"):
        engine.load_state_dict({k: v for k, v in sd.items() if k != name}, 3)
    with pytest.raises(KeyError, match="unexpected"):
        engine.load_state_dict({**sd, "model.extra.weight": sd[name]}, 3)
    with pytest.raises(ValueError, match="shape"):
        engine.load_state_dict({**sd, name: sd[name][:-1]}, 3)
    assert engine.llm.rpcs == [] and engine.version == 0


def test_a_worker_that_loads_too_little_fails_the_update(engine, monkeypatch):
    monkeypatch.setattr(engine.llm, "collective_rpc", lambda method, args=(): [1])
    with pytest.raises(RuntimeError, match="loaded"):
        engine.load_state_dict(engine.llm.engine.model.state_dict(), 2)
    assert engine.version == -1  # the weights are in an unknown state: not the old version any more


def test_missing_vllm_is_a_clear_error(model_dir, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(RuntimeError, match="pip install 'echorl\\[vllm\\]'"):
        VLLMBackend(model_dir)
