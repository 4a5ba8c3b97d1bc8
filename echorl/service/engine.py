"""The served base model with one LoRA adapter per training client (peft), and sampling from it.

:class:`Engine` holds the base model once, wrapped in a ``peft.PeftModel`` that carries every
training client's adapter by name (``PeftModel.add_adapter`` / ``set_adapter``); only the named
adapter's parameters are trained and stepped, each with its own AdamW. A sampler's weights are a
*snapshot* (:class:`Snapshot`: the adapter's tensors, cloned when ``save_weights_for_sampler``
ran); sampling copies a snapshot into a scratch adapter of the same shape and samples with the
torch engine (:class:`echorl.actor.backend.TorchBackend`), or samples the bare base model.

Not thread-safe by design: the service runs every engine call on one worker, in arrival order
(:mod:`echorl.service.scheduler`), so a training client's requests apply in the order it sent them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from echorl.actor.backend import TorchBackend
from echorl.actor.types import SamplingParams

from . import losses
from .wire import FwdBwdRequest, FwdBwdResult, SampleResult, Sequence

#: leaf module names of the attention / MLP / unembedding projections of Llama/Qwen-style models
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
IDLE_ADAPTER = "idle"
"""peft needs one adapter to exist; this one (rank 1, B = 0: the identity) is never trained."""
MICRO_BATCH_TOKENS = 4096
"""Data are run through the model in groups of about this many (padded) tokens: bounds activation
memory whatever the request size."""


class EngineError(ValueError):
    """A request the engine cannot serve (unknown adapter, module the model lacks): one line."""


@dataclass(frozen=True)
class LoraSpec:
    """How a training client's adapter is shaped (from ``create_model``'s ``lora_config``)."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    seed: int

    def key(self) -> str:
        return hashlib.sha256(json.dumps([self.rank, self.alpha, self.targets]).encode()).hexdigest()[:10]


@dataclass
class Snapshot:
    """A sampler's weights: the adapter's tensors at ``save_weights_for_sampler`` (None: the base)."""

    spec: LoraSpec | None
    tensors: dict[str, Any] | None
    ident: int = 0


@dataclass
class _Adapter:
    spec: LoraSpec
    params: list[tuple[str, Any]]
    optimizer: Any = None
    pending_tokens: int = 0
    steps: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


class Engine:
    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: str | None = None) -> None:
        from peft import LoraConfig, get_peft_model

        base = TorchBackend.from_pretrained(model_dir, device=device, dtype=dtype)
        self.model_dir = Path(model_dir).resolve()
        self.tokenizer = base.tokenizer
        self.module_names = {name.rsplit(".", 1)[-1] for name, _ in base.model.named_modules()}
        idle = LoraConfig(r=1, lora_alpha=1, target_modules=list(self._present(ATTN_MODULES + MLP_MODULES)))
        self.model = get_peft_model(base.model, idle, adapter_name=IDLE_ADAPTER)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.sampler = TorchBackend(self.model, self.tokenizer)
        self.adapters: dict[str, _Adapter] = {}
        self._slots: dict[str, int] = {}  # scratch adapter name -> ident of the snapshot it holds
        self.config = self.model.get_base_model().config
        self.max_context = int(getattr(self.config, "max_position_embeddings", 2048) or 2048)

    # ------------------------------------------------------------ adapters

    def _present(self, names: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n for n in names if n in self.module_names)

    def lora_spec(self, rank: int, alpha: float, seed: int, mlp: bool, attn: bool, unembed: bool) -> LoraSpec:
        wanted = (ATTN_MODULES if attn else ()) + (MLP_MODULES if mlp else ()) + (UNEMBED_MODULES if unembed else ())
        targets = self._present(wanted)
        if not targets:
            raise EngineError("none of the requested LoRA targets (attn/mlp/unembed) exists in the served model")
        return LoraSpec(rank=rank, alpha=alpha, targets=targets, seed=seed)

    def _add(self, name: str, spec: LoraSpec) -> list[tuple[str, Any]]:
        import torch
        from peft import LoraConfig

        cfg = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, target_modules=list(spec.targets))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            self.model.add_adapter(name, cfg)
        marker = f".{name}."
        params = sorted((n, p) for n, p in self.model.named_parameters() if marker in n)
        for _, p in params:
            p.requires_grad_(False)
        return params

    def create(self, name: str, spec: LoraSpec) -> None:
        if name in self.adapters:
            raise EngineError(f"adapter {name} exists")
        self.adapters[name] = _Adapter(spec=spec, params=self._add(name, spec))

    def delete(self, name: str) -> None:
        if self.adapters.pop(name, None) is not None:
            self.model.delete_adapter(name)
            self.model.set_adapter(IDLE_ADAPTER)

    def _activate(self, name: str) -> _Adapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise EngineError(f"no adapter {name}")
        self.model.set_adapter(name)
        for p in self.model.parameters():
            p.requires_grad_(False)
        for _, p in adapter.params:
            p.requires_grad_(True)
        return adapter

    # ------------------------------------------------------------ training

    def _micro_batches(self, req: FwdBwdRequest) -> list[list[int]]:
        groups: list[list[int]] = [[]]
        width = 0
        for i, d in enumerate(req.data):
            width = max(width, len(d.tokens))
            if groups[-1] and width * (len(groups[-1]) + 1) > MICRO_BATCH_TOKENS:
                groups.append([])
                width = len(d.tokens)
            groups[-1].append(i)
        return groups

    def _target_logprobs(self, req: FwdBwdRequest, idx: list[int]) -> list[Any]:
        import torch

        device = self.sampler.device
        width = max(len(req.data[i].tokens) for i in idx)
        ids = torch.full((len(idx), width), self.sampler.pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        targets = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            d = req.data[i]
            ids[row, : len(d.tokens)] = torch.tensor(d.tokens)
            mask[row, : len(d.tokens)] = 1
            targets[row, : len(d.tokens)] = torch.as_tensor(d.inputs["target_tokens"], dtype=torch.long)
        vocab = int(self.config.vocab_size)
        if int(ids.max()) >= vocab or int(targets.max()) >= vocab or int(ids.min()) < 0 or int(targets.min()) < 0:
            raise EngineError(f"token id out of the model's vocabulary (size {vocab})")
        logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.to(device)[..., None]).squeeze(-1)
        return [logp[row, : len(req.data[i].tokens)] for row, i in enumerate(idx)]

    def forward_backward(self, name: str, req: FwdBwdRequest) -> FwdBwdResult:
        """Target log-probs and the request's loss; its gradient accumulates on the adapter
        (``forward_only``: none) until :meth:`optim_step`."""
        import torch

        for i, d in enumerate(req.data):
            losses.check_inputs(req.loss_fn, d.inputs, i)
            if len(d.tokens) > self.max_context:
                raise EngineError(f"datum {i}: {len(d.tokens)} tokens, the model's context is {self.max_context}")
        adapter = self._activate(name)
        outputs: list[dict[str, np.ndarray]] = [{} for _ in req.data]
        total = 0.0
        for idx in self._micro_batches(req):
            with torch.set_grad_enabled(not req.forward_only):
                logps = self._target_logprobs(req, idx)
                per_token = [
                    losses.elementwise(req.loss_fn, lp, req.data[i].inputs, req.config) for lp, i in zip(logps, idx)
                ]
                loss = torch.stack([t.sum() for t in per_token]).sum()
                if not torch.isfinite(loss):
                    raise EngineError("the loss is not finite (check the advantages and log-probs sent)")
                if not req.forward_only:
                    loss.backward()
            total += float(loss.detach())
            for lp, el, i in zip(logps, per_token, idx):
                outputs[i] = {
                    "logprobs": lp.detach().float().cpu().numpy(),
                    "elementwise_loss": el.detach().float().cpu().numpy(),
                }
        if not req.forward_only:
            adapter.pending_tokens += sum(len(d.tokens) for d in req.data)
        return FwdBwdResult(outputs=outputs, metrics={"loss:sum": total})

    def optim_step(self, name: str, lr: float, beta1: float, beta2: float, eps: float, wd: float, clip: float) -> dict:
        """One AdamW step on the accumulated gradient with the request's hyper-parameters."""
        import torch

        adapter = self._activate(name)
        params = [p for _, p in adapter.params]
        if adapter.optimizer is None:
            adapter.optimizer = torch.optim.AdamW(params, lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
        for group in adapter.optimizer.param_groups:
            group.update(lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd)
        grads = [p.grad for p in params if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        if clip > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(params, clip, torch.tensor(norm))
        if grads and np.isfinite(norm):
            adapter.optimizer.step()
            adapter.steps += 1
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.pending_tokens = 0
        return {"grad_norm:mean": norm}

    # ------------------------------------------------------------ snapshots and state

    def snapshot(self, name: str, ident: int) -> Snapshot:
        from peft import get_peft_model_state_dict

        adapter = self._activate(name)
        state = get_peft_model_state_dict(self.model, adapter_name=name, save_embedding_layers=False)
        return Snapshot(spec=adapter.spec, tensors={k: v.detach().clone() for k, v in state.items()}, ident=ident)

    def save_state(self, name: str, out: Path, meta: dict[str, Any]) -> None:
        """Adapter tensors (safetensors), optimizer state and the adapter's shape, into ``out``."""
        import torch
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file

        adapter = self._activate(name)
        out.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(self.model, adapter_name=name, save_embedding_layers=False)
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(out / "adapter.safetensors"))
        if adapter.optimizer is not None:
            torch.save(adapter.optimizer.state_dict(), out / "optimizer.pt")
        spec = adapter.spec
        info = {"rank": spec.rank, "alpha": spec.alpha, "targets": list(spec.targets), "seed": spec.seed, **meta}
        (out / "meta.json").write_text(json.dumps(info))

    @staticmethod
    def read_spec(src: Path) -> LoraSpec:
        try:
            info = json.loads((src / "meta.json").read_text())
            return LoraSpec(int(info["rank"]), float(info["alpha"]), tuple(info["targets"]), int(info["seed"]))
        except (OSError, ValueError, KeyError) as exc:
            raise EngineError(f"not a checkpoint of this server: {exc}") from None

    def load_state(self, name: str, src: Path, optimizer: bool) -> None:
        """Adapter tensors (and with ``optimizer`` the AdamW state) from :meth:`save_state`'s directory."""
        import torch
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        adapter = self._activate(name)
        if self.read_spec(src) != adapter.spec:
            raise EngineError("the checkpoint's LoRA shape differs from this training client's")
        set_peft_model_state_dict(self.model, load_file(str(src / "adapter.safetensors")), adapter_name=name)
        adapter.optimizer = None
        if optimizer and (src / "optimizer.pt").is_file():
            params = [p for _, p in adapter.params]
            adapter.optimizer = torch.optim.AdamW(params)
            adapter.optimizer.load_state_dict(torch.load(src / "optimizer.pt", weights_only=True))

    # ------------------------------------------------------------ sampling

    def _use(self, snap: Snapshot) -> None:
        from peft import set_peft_model_state_dict

        assert snap.spec is not None and snap.tensors is not None
        slot = f"sample_{snap.spec.key()}"
        if slot not in self._slots:
            self._add(slot, snap.spec)
            self._slots[slot] = -1
        if self._slots[slot] != snap.ident:
            set_peft_model_state_dict(self.model, snap.tensors, adapter_name=slot)
            self._slots[slot] = snap.ident
        self.model.set_adapter(slot)
        for p in self.model.parameters():
            p.requires_grad_(False)

    def sample(
        self,
        snap: Snapshot,
        prompt: list[int],
        n: int,
        params: SamplingParams,
        seed: int | None,
        stop_tokens: list[int],
        prompt_logprobs: bool,
    ) -> SampleResult:
        """``n`` completions of ``prompt`` with the snapshot's adapter (or the bare base)."""
        import contextlib

        import torch

        if max(prompt, default=0) >= int(self.config.vocab_size) or min(prompt, default=0) < 0:
            raise EngineError("prompt token id out of the model's vocabulary")
        if snap.tensors is not None:
            self._use(snap)
            ctx: Any = contextlib.nullcontext()
        else:
            ctx = self.model.disable_adapter()
        with ctx:
            samples = self.sampler.sample_ids([list(prompt)] * n, params, seed)
            plp = None
            if prompt_logprobs:
                with torch.inference_mode():
                    ids = torch.tensor([prompt], device=self.sampler.device)
                    logits = self.model(input_ids=ids).logits.float()
                lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)  # one device
                plp = [None, *lp.tolist()]
        sequences = []
        for s in samples:
            tokens, logps, reason = s.token_ids, s.logprobs, s.finish_reason
            cut = next((i for i, t in enumerate(tokens) if t in stop_tokens), None)
            if cut is not None:
                tokens, logps, reason = tokens[: cut + 1], logps[: cut + 1], "stop"
            sequences.append(Sequence(tokens=list(tokens), logprobs=list(logps), stop_reason=reason))
        return SampleResult(sequences=sequences, prompt_logprobs=plp)
