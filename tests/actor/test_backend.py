"""Actor side: the default-model builder (cache), loading a saved HF directory, sampling."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from echorl.actor.types import RolloutGroup, Sample, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from echorl.actor.model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("m") / "tiny", seed=0, warmup=None)


def test_builder_writes_hf_dir_and_reuses_it(model_dir):
    from echorl.actor.model import MARKER, build_default_model

    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= names
    marker = json.loads((model_dir / MARKER).read_text())
    assert 400_000 < marker["parameters"] < 600_000
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_default_model(model_dir, seed=0, warmup=None) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime  # cached, not rebuilt


def test_builder_is_deterministic(model_dir, tmp_path):
    from echorl.actor.model import build_default_model

    other = build_default_model(tmp_path / "again", seed=0, warmup=None)
    assert (other / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_load_saved_hf_directory_and_sample(model_dir):
    from transformers import AutoModelForCausalLM

    from echorl.actor.backend import InferenceBackend, TorchBackend

    # a model saved by plain transformers (not by our builder) loads through --model PATH
    plain = model_dir.parent / "plain"
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(plain)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (plain / f).write_bytes((model_dir / f).read_bytes())
    b = TorchBackend.from_pretrained(plain)
    assert isinstance(b, InferenceBackend) and b.version == 0
    out = b.generate(["12+34=", "7+8="], 3, SamplingParams(max_new_tokens=5), seed=1)
    assert [len(g) for g in out] == [3, 3] and all(isinstance(s, Sample) for g in out for s in g)
    for s in out[0]:
        assert 1 <= len(s.token_ids) <= 5 and len(s.logprobs) == len(s.token_ids)
        assert all(lp <= 0 for lp in s.logprobs) and s.finish_reason in ("stop", "length")
        assert s.finish_reason == "stop" or len(s.token_ids) == 5
    again = b.generate(["12+34=", "7+8="], 3, SamplingParams(max_new_tokens=5), seed=1)
    assert again == out  # seeded sampling is reproducible
    with pytest.raises(FileNotFoundError):
        TorchBackend.from_pretrained(model_dir.parent / "missing")


def test_batched_logprobs_match_single_prompt(model_dir):
    from echorl.actor.backend import TorchBackend

    b = TorchBackend.from_pretrained(model_dir)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    both = b.generate(["1+2=", "123+456="], 1, greedy)
    alone = b.generate(["1+2="], 1, greedy)
    assert both[0][0].token_ids == alone[0][0].token_ids
    assert both[0][0].logprobs == pytest.approx(alone[0][0].logprobs, abs=1e-4)


def test_a_model_that_takes_its_cache_as_past_key_values_samples_the_same(model_dir):
    """transformers before ~5.2x names the KV cache ``past_key_values`` (pyproject allows 4.56+;
    the GPU image here had 5.17): the backend passes it under whichever name the model takes."""
    import torch
    from transformers import AutoModelForCausalLM

    from echorl.actor.backend import TorchBackend

    class OlderSignature(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
            return self.inner(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=past_key_values,
                use_cache=use_cache,
            )

    new = TorchBackend.from_pretrained(model_dir)
    old = TorchBackend(OlderSignature(AutoModelForCausalLM.from_pretrained(model_dir).eval()), new.tokenizer)
    params = SamplingParams(max_new_tokens=8)
    assert old.generate(["12+34=", "7+8="], 4, params, sampling_seed=3) == new.generate(
        ["12+34=", "7+8="], 4, params, sampling_seed=3
    )


def test_stop_strings_top_p_and_eos(model_dir):
    from echorl.actor.backend import TorchBackend, measure_tokens_per_second

    b = TorchBackend.from_pretrained(model_dir)
    free = b.generate(["9+9="], 16, SamplingParams(max_new_tokens=6), seed=2)[0]
    stop_char = next(s.text[1] for s in free if len(s.text) > 2)
    stopped = b.generate(["9+9="], 16, SamplingParams(max_new_tokens=6, stop=[stop_char]), seed=2)[0]
    for f, s in zip(free, stopped):
        assert stop_char not in s.text
        if stop_char in f.text:
            assert s.finish_reason == "stop" and f.text.startswith(s.text)
    narrow = b.generate(["9+9="], 8, SamplingParams(max_new_tokens=3, top_p=1e-6), seed=5)[0]
    greedy = b.generate(["9+9="], 1, SamplingParams(temperature=0.0, max_new_tokens=3))[0][0]
    assert all(s.token_ids == greedy.token_ids for s in narrow)  # top-p -> only the top token
    assert measure_tokens_per_second(b, batch=4, new_tokens=4) > 0


def test_types_validate_and_roundtrip():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        Sample([1, 2], [-0.1], "stop", "x")
    g = RolloutGroup("p", "1+1=", [1, 2], [Sample([3], [-0.2], "length", "2")], 7, [1.0], {"generate_s": 0.1})
    assert RolloutGroup.from_dict(g.to_dict()) == g


def test_vllm_backend_reports_missing_dependency():
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
    except ImportError:
        from echorl.actor.vllm_backend import VLLMBackend

        with pytest.raises(RuntimeError, match="needs vLLM"):
            VLLMBackend("/nonexistent")
    else:
        pytest.skip("vLLM installed: the missing-dependency path cannot be exercised")
