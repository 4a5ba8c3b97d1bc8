"""A stand-in for the ``vllm`` module (test double): the few parts of its API the vLLM engine uses
(``LLM``, ``SamplingParams``, request/completion outputs, ``collective_rpc`` with a worker
extension), running a real torch model on the CPU so sampled tokens and log-probs are genuine.

It mirrors vLLM's behaviour as ``actor/vllm_backend.py`` documents it, not vLLM's code: it proves
the adapter's translation, extraction and update transport, not that vLLM behaves as documented.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from echorl.actor.backend import TorchBackend
from echorl.actor.types import SamplingParams as EchoParams

_SAMPLING_FIELDS = {"n", "temperature", "top_p", "max_tokens", "stop", "logprobs", "seed"}


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        unknown = set(kwargs) - _SAMPLING_FIELDS
        if unknown:
            raise TypeError(f"unexpected SamplingParams fields {unknown}")
        self.kwargs = kwargs
        for k, v in kwargs.items():
            setattr(self, k, v)


@dataclass
class Logprob:
    logprob: float
    rank: int = 1


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class _ModelRunner:
    """vLLM's model runner: ``get_model()`` returns a model with ``load_weights`` (HF names)."""

    def __init__(self, hf_model: Any) -> None:
        self.model = _VllmModel(hf_model)

    def get_model(self) -> Any:
        return self.model


class _VllmModel:
    def __init__(self, hf_model: Any) -> None:
        self.hf = hf_model
        self.loaded: list[str] = []

    def load_weights(self, weights: Any) -> set[str]:
        import torch

        params = dict(self.hf.named_parameters())
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor.to(params[name].dtype))
                self.loaded.append(name)
        return set(self.loaded)


class _Worker:
    def __init__(self, hf_model: Any) -> None:
        self.model_runner = _ModelRunner(hf_model)


class LLM:
    """``vllm.LLM`` over a :class:`TorchBackend`; counts constructions (a restart would show)."""

    constructed = 0

    def __init__(
        self,
        model: str,
        gpu_memory_utilization: float = 0.9,
        logprobs_mode: str = "raw_logprobs",
        worker_extension_cls: str = "",
        **kwargs: Any,
    ) -> None:
        type(self).constructed += 1
        self.init_kwargs = {
            "gpu_memory_utilization": gpu_memory_utilization,
            "logprobs_mode": logprobs_mode,
            "worker_extension_cls": worker_extension_cls,
            **kwargs,
        }
        self.engine = TorchBackend.from_pretrained(model)
        module, _, name = worker_extension_cls.rpartition(".")
        extension = getattr(importlib.import_module(module), name)
        self.worker = type("Worker", (extension, _Worker), {})(self.engine.model)  # what vLLM does with the class
        self.sampling: list[SamplingParams] = []
        self.rpcs: list[tuple[str, tuple]] = []
        self.prefix_resets = 0

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.rpcs.append((method, args))
        return [getattr(self.worker, method)(*args)]

    def reset_prefix_cache(self) -> bool:
        self.prefix_resets += 1
        return True

    def generate(
        self, prompts: list[dict], sampling_params: list[SamplingParams], use_tqdm: bool = True
    ) -> list[RequestOutput]:
        assert self.init_kwargs["logprobs_mode"] == "processed_logprobs"
        outs = []
        for prompt, sp in zip(prompts, sampling_params, strict=True):
            self.sampling.append(sp)
            ids = list(prompt["prompt_token_ids"])
            params = EchoParams(
                temperature=sp.temperature, top_p=sp.top_p, max_new_tokens=sp.max_tokens, stop=list(sp.stop or [])
            )
            samples = self.engine.sample_ids([ids] * sp.n, params, sp.seed)
            out = RequestOutput(ids)
            for i, s in enumerate(samples):
                # logprobs=0: the sampled token, plus (as vLLM does) the top-1 token when it differs
                steps = [{tok: Logprob(lp), -1: Logprob(0.0)} for tok, lp in zip(s.token_ids, s.logprobs)]
                out.outputs.append(CompletionOutput(i, s.text, list(s.token_ids), steps, s.finish_reason))
            outs.append(out)
        return outs
