"""Inference backends: "given weights of version v and a batch of prompts, return G samples per
prompt with token ids, per-token behaviour log-probs, finish reason and timings".

:class:`TorchBackend` runs any local Hugging Face causal-LM directory with torch/transformers
on CPU or CUDA: left-padded batched sampling with a KV cache, temperature, top-p, max new tokens,
stop strings, and in-place weight loading (``load_state_dict``) that never rebuilds the model.
The vLLM backend lives in :mod:`echorl.actor.vllm_backend` and is imported only on request.

Thread safety: one backend instance must not be used by two threads at once; nothing here
relies on thread-local state, so ``trio.to_thread.run_sync(backend.generate, ...)`` is fine.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from . import lora
from .seeded import SeededRows, top_p_filter
from .types import Sample, SamplingParams


@runtime_checkable
class InferenceBackend(Protocol):
    """What an actor needs from an inference engine."""

    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Copy new weights in place (no model rebuild) and set :attr:`version`."""
        ...

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        group_size: int,
        params: SamplingParams,
        seed: int | None = None,
        sampling_seed: int | None = None,
    ) -> list[list[Sample]]:
        """``group_size`` samples for each prompt (text, or token ids used as given), in prompt
        order; ``sampling_seed`` (a lease's):
        seeded Gumbel-max sampling (``actor/seeded.py``), sample ``k·G + j`` for draw j of prompt k."""
        ...


def cache_keyword(model: Any) -> str:
    """The name under which ``model.forward`` takes its KV cache: ``cache`` in recent transformers
    5 releases, ``past_key_values`` before them (4.56–5.17 at least; ``pyproject.toml`` allows
    both). A cache passed under a name the model does not know would be swallowed by its
    ``**kwargs``: every step would then see one token without its prefix."""
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: its **kwargs
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


class TorchBackend:
    """torch/transformers backend for a causal LM (any ``AutoModelForCausalLM`` directory)."""

    def __init__(self, model: Any, tokenizer: Any, version: int = 0) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._version = int(version)
        self.device = next(model.parameters()).device
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.config.eos_token_id
        self.eos_ids: set[int] = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        pad = tokenizer.pad_token_id
        self.pad_id: int = int(pad if pad is not None else next(iter(self.eos_ids), 0))
        # a peft model loads its adapter's tensors only (actor/lora.py); any other, every weight
        self._load_weights = lora.weights_loader(model) or self._copy_weights
        self._cache_arg = cache_keyword(model)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "cpu", dtype: str | None = None) -> TorchBackend:
        """Load model and tokenizer from a local HF directory (never downloads)."""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        kw: dict[str, Any] = {"local_files_only": True}
        if dtype:
            kw["dtype"] = getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(path, **kw).to(device).eval()
        return cls(model, tok)

    @property
    def version(self) -> int:
        return self._version

    def load_state_dict(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Copy tensors into the existing parameters (strict: names and shapes must match); for a
        model with a LoRA adapter, the adapter's tensors."""
        self._load_weights(state_dict)
        self._version = int(version)

    def _copy_weights(self, state_dict: Mapping[str, Any]) -> None:
        import torch

        params = dict(self.model.state_dict())
        missing = [k for k in params if k not in state_dict and not self._tied(k)]
        unexpected = [k for k in state_dict if k not in params]
        if missing or unexpected:
            raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, value in state_dict.items():
                target = params[name]
                src = torch.as_tensor(value)
                if src.shape != target.shape:
                    raise ValueError(f"{name}: shape {tuple(src.shape)} != {tuple(target.shape)}")
                target.copy_(src.to(dtype=target.dtype, device=target.device))

    def _tied(self, name: str) -> bool:
        return name == "lm_head.weight" and bool(getattr(self.model.config, "tie_word_embeddings", False))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        group_size: int,
        params: SamplingParams,
        seed: int | None = None,
        sampling_seed: int | None = None,
    ) -> list[list[Sample]]:
        """Sample ``group_size`` completions per prompt in one batch (a prompt is text, or token
        ids used as given). ``seed`` makes the sampling reproducible (a private generator; the
        global RNG is untouched); ``sampling_seed`` makes it seeded (replayable by the learner,
        ``actor/seeded.py``)."""
        ids = [list(p) if isinstance(p, list) else self.encode(p) for p in prompts]
        flat = [row for row in ids for _ in range(group_size)]
        seeded = None
        if sampling_seed is not None:
            seeded = SeededRows(int(sampling_seed), list(range(len(flat))), [0] * len(flat), params.max_new_tokens)
        samples = self.sample_ids(flat, params, seed, seeded)
        return [samples[i * group_size : (i + 1) * group_size] for i in range(len(prompts))]

    def sample_ids(
        self,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        seed: int | None = None,
        seeded: SeededRows | None = None,
    ) -> list[Sample]:
        """Sample one completion per row of token ids (``seeded``: by the lease's seeded noise,
        ``seed`` is then unused)."""
        import torch
        from transformers import DynamicCache

        if not prompt_ids:
            return []
        gen = torch.Generator(device=self.device)
        gen.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        b, width = len(prompt_ids), max(len(r) for r in prompt_ids)
        if width == 0:
            raise ValueError("empty prompt")
        input_ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, row in enumerate(prompt_ids):
            input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row) :] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        tokens: list[list[int]] = [[] for _ in range(b)]
        logps: list[list[float]] = [[] for _ in range(b)]
        reasons = ["length"] * b
        texts: list[str | None] = [None] * b
        done = torch.zeros(b, dtype=torch.bool, device=self.device)
        temp = float(params.temperature)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.inference_mode():
                cache = DynamicCache(config=self.model.config)
                kv = {self._cache_arg: cache}
                out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=True, **kv)
                for step in range(params.max_new_tokens):
                    logits = out.logits[:, -1, :].float()
                    logp_all = torch.log_softmax(logits / (temp if temp > 0 else 1.0), dim=-1)
                    if seeded is not None:
                        nxt = seeded.choose(logits, step, temp, params.top_p)
                    elif temp == 0:
                        nxt = logits.argmax(-1)
                    else:
                        probs = torch.softmax(top_p_filter(logits / temp, params.top_p), dim=-1)
                        nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
                    lp = logp_all.gather(-1, nxt[:, None]).squeeze(-1)
                    nxt_l, lp_l = nxt.tolist(), lp.tolist()
                    for i in range(b):
                        if done[i]:
                            continue
                        tokens[i].append(nxt_l[i])
                        logps[i].append(lp_l[i])
                        if nxt_l[i] in self.eos_ids:
                            reasons[i] = "stop"
                            done[i] = True
                        elif params.stop:
                            text = self.tokenizer.decode(tokens[i], skip_special_tokens=True)
                            cut = min((text.find(s) for s in params.stop if s in text), default=-1)
                            if cut >= 0:
                                reasons[i], texts[i] = "stop", text[:cut]
                                done[i] = True
                    if bool(done.all()):
                        break
                    step_ids = torch.where(done, torch.full_like(nxt, self.pad_id), nxt)[:, None]
                    mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], 1)
                    pos = pos[:, -1:] + 1
                    out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos, use_cache=True, **kv)
        finally:
            if was_training:
                self.model.train()
        result = []
        for i in range(b):
            text = texts[i]
            if text is None:
                text = self.tokenizer.decode(tokens[i], skip_special_tokens=True)
            result.append(Sample(token_ids=tokens[i], logprobs=logps[i], finish_reason=reasons[i], text=text))
        return result


def measure_tokens_per_second(
    backend: InferenceBackend, batch: int = 32, new_tokens: int = 16, prompt: str = "1+1="
) -> float:
    """Generated tokens per second of any backend for ``batch`` samples of one prompt (the
    capability record's figure), through the ``InferenceBackend`` interface only."""
    params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens)
    t0 = time.perf_counter()
    (samples,) = backend.generate([prompt], batch, params, seed=0)
    dt = time.perf_counter() - t0
    return sum(len(s.token_ids) for s in samples) / max(dt, 1e-9)
