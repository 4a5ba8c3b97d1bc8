"""vLLM inference backend behind the :class:`~echorl.actor.backend.InferenceBackend` interface.

Chosen with ``echorl node --engine vllm`` (``node/daemon.py`` checks that vLLM is installed and a CUDA
device is present first). UNTESTED: vLLM is not installed on the development machine (CPU only); this module is imported
only when a user asks for it, and it fails with a clear message when vLLM is missing. What it
relies on and what may differ across vLLM versions:

* ``SamplingParams(n=G, logprobs=0)`` returns the sampled token's log-prob per position. vLLM
  computes it from the *processed* logits by default in recent versions (temperature applied),
  which matches :class:`echorl.actor.types.SamplingParams` semantics only when
  ``logprobs_mode="processed_logprobs"`` is available; the learner's truncated importance
  weights absorb small differences, large ones show up as ``logp_abs_diff`` in the metrics.
* In-place weight loading goes through ``model.load_weights(iterable of (name, tensor))`` on
  the driver worker, reached with ``LLM.collective_rpc`` (vLLM >= 0.7) or the legacy
  ``llm_engine.model_executor.driver_worker`` path. Tensor-parallel setups are not handled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .types import Sample, SamplingParams


class VLLMBackend:
    """Sampling with vLLM; same contract as :class:`echorl.actor.backend.TorchBackend`."""

    def __init__(self, path: str | Path, gpu_memory_utilization: float = 0.5, **engine_kwargs: Any) -> None:
        try:
            import vllm  # type: ignore[import-not-found]
        except ImportError:
            raise RuntimeError("the vLLM backend needs vLLM: pip install 'echorl[vllm]'") from None
        self._vllm = vllm
        kwargs = {"logprobs_mode": "processed_logprobs", **engine_kwargs}
        try:
            self.llm = vllm.LLM(model=str(path), gpu_memory_utilization=gpu_memory_utilization, **kwargs)
        except TypeError:  # older vLLM without logprobs_mode
            kwargs.pop("logprobs_mode", None)
            self.llm = vllm.LLM(model=str(path), gpu_memory_utilization=gpu_memory_utilization, **kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    def load_state_dict(self, state_dict: Mapping[str, Any], version: int) -> None:
        items = list(state_dict.items())

        def _load(worker: Any) -> None:  # runs inside the worker process
            worker.model_runner.model.load_weights(items)

        if hasattr(self.llm, "collective_rpc"):
            self.llm.collective_rpc(_load)
        else:
            _load(self.llm.llm_engine.model_executor.driver_worker)
        if hasattr(self.llm, "reset_prefix_cache"):
            self.llm.reset_prefix_cache()  # cached KV of old weights must not be reused
        self._version = int(version)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(
        self, prompts: list[str], group_size: int, params: SamplingParams, seed: int | None = None
    ) -> list[list[Sample]]:
        sp = self._vllm.SamplingParams(
            n=group_size, temperature=params.temperature, top_p=params.top_p,
            max_tokens=params.max_new_tokens, stop=list(params.stop) or None, logprobs=0, seed=seed,
        )
        token_prompts = [{"prompt_token_ids": self.encode(p)} for p in prompts]
        outputs = self.llm.generate(token_prompts, sp, use_tqdm=False)
        result: list[list[Sample]] = []
        for out in outputs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs or [])]
                reason = "stop" if c.finish_reason == "stop" else "length"
                group.append(Sample(token_ids=ids, logprobs=lps, finish_reason=reason, text=c.text))
            result.append(group)
        return result
