"""vLLM inference engine behind the :class:`~echorl.actor.backend.InferenceBackend` interface.

Chosen with ``echorl node --engine vllm`` (``node/daemon.py`` checks first that vLLM is installed
and that the device is ``cuda:0``). **UNTESTED against a real vLLM**: the development machine
has no GPU and the official vLLM wheels are CUDA builds. Everything above vLLM's own API (the
translation of sampling parameters, the extraction of log-probs, the checks and the transport of
a weight update) is tested on the CPU with a stand-in ``vllm`` module (``tests/actor/fake_vllm.py``);
``scripts/gpu-check.sh`` exercises the real engine where there is one.

Written for vLLM ``>=0.10.2,<0.13`` (the ``vllm`` extra pins that range); what it relies on:

* ``LLM(..., logprobs_mode="processed_logprobs", worker_extension_cls=...)``. vLLM's processed
  log-probs are taken after temperature *and* after top-k/top-p truncation, while echorl's
  behaviour log-prob is ``log_softmax(logits / T)`` before top-p (``actor/types.py``). They agree
  when ``top_p == 1`` (what the learner sends) or when sampling is greedy (vLLM then returns the
  log-probs of the raw logits, as the torch backend does for T = 0); any other ``top_p`` is
  refused here rather than reported wrong.
* ``SamplingParams(n, temperature, top_p, max_tokens, stop, logprobs=0, seed)``: ``logprobs=0``
  returns, per generated position, a dict holding the sampled token's ``Logprob``.
* Prompts as ``{"prompt_token_ids": [...]}`` (the node tokenizes without special tokens, as the
  learner does, so no BOS is added), ``CompletionOutput.token_ids`` ending with EOS when EOS
  stopped it, ``text`` without the stop string.
* In-place weight updates: the verified snapshot is written once as a safetensors file (on
  ``/dev/shm`` where present) and ``LLM.collective_rpc("echorl_load_weights_file", args=(path,))``
  makes every worker call its model's ``load_weights`` (``actor/vllm_worker.py``); then
  ``reset_prefix_cache()`` so no KV computed with old weights is reused. The process is never
  restarted. Names and shapes are checked here first against the model directory's own
  checkpoint, so a wrong snapshot is refused before the engine is touched.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .types import Sample, SamplingParams
from .vllm_worker import EXTENSION

VLLM_RANGE = ">=0.10.2,<0.13"
LOAD_METHOD = "echorl_load_weights_file"


def sampling_kwargs(params: SamplingParams, n: int, seed: int | None) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for ``n`` samples of one prompt."""
    if params.top_p < 1.0 and params.temperature > 0:
        raise ValueError(
            f"the vLLM engine cannot report pre-truncation log-probs with top_p={params.top_p}; "
            "echorl leases use top_p=1"
        )
    return {
        "n": int(n),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "max_tokens": int(params.max_new_tokens),
        "stop": list(params.stop) or None,
        "logprobs": 0,
        "seed": seed,
    }


def to_sample(completion: Any) -> Sample:
    """A vLLM ``CompletionOutput`` as a :class:`Sample`: the sampled token's log-prob at each step."""
    ids = [int(t) for t in completion.token_ids]
    steps = completion.logprobs
    if steps is None or len(steps) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if steps is None else len(steps)} log-prob steps for {len(ids)} tokens")
    lps = []
    for tok, step in zip(ids, steps):
        entry = step.get(tok) if step else None
        if entry is None:
            raise RuntimeError(f"vLLM returned no log-prob for sampled token {tok}")
        lp = float(entry.logprob)
        if math.isnan(lp):
            raise RuntimeError(f"vLLM returned a NaN log-prob for token {tok}")
        lps.append(min(lp, 0.0))
    if completion.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a completion with {completion.finish_reason!r}")
    return Sample(token_ids=ids, logprobs=lps, finish_reason=str(completion.finish_reason), text=str(completion.text))


def row_seed(seed: int | None, row: int) -> int | None:
    """A distinct seed per request (identical prompts in one batch must not draw the same sample)."""
    return None if seed is None else (int(seed) * 1_000_003 + row) % (2**63)


def _refuse_seeded(seeded: object) -> None:
    if seeded is not None:
        raise NotImplementedError(
            "this learner asks for seeded sampling, which the vLLM engine does not do yet: use --engine torch, "
            "or start the learner with --no-sampling-proofs"
        )


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the model directory's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise FileNotFoundError(f"{model_dir}: no safetensors checkpoint (the vLLM engine needs one to check updates)")
    return shapes


def update_tensors(state_dict: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The tensors of an update, checked like ``TorchBackend.load_state_dict`` (strict names and
    shapes). A tied ``lm_head.weight`` the checkpoint does not store is dropped (vLLM ties it)."""
    import torch

    extra = [k for k in state_dict if k not in expected and k != "lm_head.weight"]
    missing = [k for k in expected if k not in state_dict]
    if missing or extra:
        raise KeyError(f"state dict mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
    out = {}
    for name, shape in expected.items():
        t = torch.as_tensor(state_dict[name])
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} != {shape}")
        out[name] = t.contiguous()
    return out


class VLLMBackend:
    """Sampling with vLLM; the same contract as :class:`echorl.actor.backend.TorchBackend`.

    ``vllm_module`` replaces ``import vllm`` (tests inject a stand-in); ``engine_kwargs`` go to
    ``vllm.LLM`` (``dtype``, ``seed``, ``max_model_len``, ...)."""

    def __init__(
        self, path: str | Path, gpu_memory_utilization: float = 0.5, *, vllm_module: Any = None, **engine_kwargs: Any
    ) -> None:
        if vllm_module is None:
            try:
                import vllm as vllm_module  # type: ignore[import-not-found, no-redef]
            except ImportError:
                raise RuntimeError(f"the vLLM engine needs vLLM{VLLM_RANGE}: pip install 'echorl[vllm]'") from None
        self._vllm = vllm_module
        self.path, self.gpu_memory_utilization, self.engine_kwargs = str(path), gpu_memory_utilization, engine_kwargs
        self.expected = checkpoint_shapes(path)
        kwargs = {"logprobs_mode": "processed_logprobs", "worker_extension_cls": EXTENSION, **engine_kwargs}
        self.llm = vllm_module.LLM(model=str(path), gpu_memory_utilization=gpu_memory_utilization, **kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self._version = 0
        self.adapter: Any = None  # an AdapterSlot (vllm_lora.py) once versions are LoRA adapters

    def with_adapter(self, settings: Any) -> VLLMBackend:
        """This engine rebuilt with vLLM's LoRA support for ``settings`` (once per node process:
        vLLM enables LoRA only at construction); versions are then adapters (``vllm_lora.py``)."""
        from .vllm_lora import AdapterSlot, engine_kwargs

        del self.llm  # its GPU memory goes before the new engine takes its own
        engine = VLLMBackend(
            self.path,
            self.gpu_memory_utilization,
            vllm_module=self._vllm,
            **{**self.engine_kwargs, **engine_kwargs(settings)},
        )
        engine.adapter = AdapterSlot(settings, self.path)
        return engine

    @property
    def version(self) -> int:
        return self._version

    def load_state_dict(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Update the running engine's weights in place (see the module docstring); with an
        adapter, the next requests use this adapter version (``vllm_lora.py``)."""
        from safetensors.torch import save_file

        if self.adapter is not None:
            self.adapter.load(state_dict, version)
            self._version = int(version)
            return

        tensors = update_tensors(state_dict, self.expected)
        shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        with tempfile.TemporaryDirectory(prefix="echorl-vllm-", dir=shm) as tmp:
            path = os.path.join(tmp, "update.safetensors")
            save_file(tensors, path)
            self._version = -1  # until every worker confirms, the engine's weights are unknown
            counts = self.llm.collective_rpc(LOAD_METHOD, args=(path,))
        if not counts or any(int(c) != len(tensors) for c in counts):
            raise RuntimeError(f"vLLM workers loaded {counts} tensors of {len(tensors)}")
        self.llm.reset_prefix_cache()
        self._version = int(version)

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
        """``group_size`` samples per prompt (text, or token ids used as given): one vLLM request
        with ``n = group_size`` each.
        Seeded sampling (a lease's ``sampling_seed``) is not wired into vLLM yet: the rule exists
        as ``actor/seeded.py:VLLMSeededProcessor`` (unrun: no GPU here), but vLLM's V1 engine has
        no per-request logits processors and reports processed log-probs; so this refuses rather
        than sample with noise the learner's replay would reject."""
        _refuse_seeded(sampling_seed)
        return self._run(
            [list(p) if isinstance(p, list) else self.encode(p) for p in prompts], params, group_size, seed
        )

    def sample_ids(
        self, prompt_ids: list[list[int]], params: SamplingParams, seed: int | None = None, seeded: Any = None
    ) -> list[Sample]:
        """One completion per row of token ids (the multi-turn path, ``actor/episodes.py``)."""
        _refuse_seeded(seeded)
        return [group[0] for group in self._run(prompt_ids, params, 1, seed)]

    def _run(self, rows: list[list[int]], params: SamplingParams, n: int, seed: int | None) -> list[list[Sample]]:
        if not rows:
            return []
        if any(not r for r in rows):
            raise ValueError("empty prompt")
        sps = [self._vllm.SamplingParams(**sampling_kwargs(params, n, row_seed(seed, i))) for i in range(len(rows))]
        lora = {} if self.adapter is None else {"lora_request": self.adapter.request}
        outputs = self.llm.generate([{"prompt_token_ids": list(r)} for r in rows], sps, use_tqdm=False, **lora)
        if len(outputs) != len(rows):
            raise RuntimeError(f"vLLM answered {len(outputs)} requests of {len(rows)}")
        groups = [[to_sample(c) for c in out.outputs] for out in outputs]
        if any(len(g) != n for g in groups):
            raise RuntimeError(f"vLLM returned a group of other than {n} samples")
        return groups
