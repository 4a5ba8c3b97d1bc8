"""GRPO learner: group-normalised advantages, clipped ratio against the behaviour policy,
truncated importance weights, optional KL to a reference, token- or sequence-level
normalisation.

Nothing a rollout carries can make the weights non-finite: the log-ratio is clamped to ±``MAX_LOG_RATIO``
before ``exp`` (behaviour log-probs are also bounded at the wire, ``limits.MIN_LOGPROB``); a step
whose loss or gradient is still non-finite is skipped (no optimizer step, version unchanged,
``skipped == "nonfinite"``), and a batch with no trainable token is skipped (``skipped == "empty"``).

Per completion token with log-prob ``l`` under the current policy, behaviour log-prob ``l_b``
(returned by the actor, policy version b) and advantage ``A`` of its sample:

    r = exp(clamp(l - l_b, -20, 20))                   ratio pi_theta / pi_b
    s = min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)        PPO clipped surrogate
    if A < 0 and r > tis_cap:  s = min(r, tis_cap) * A   (value), gradient tis_cap * A * dl
    loss_tok = -s + kl_coef * (exp(l_ref - l) - (l_ref - l) - 1)     (k3 KL estimator)
               - entropy_coef * H(pi_theta(. | prefix))            (entropy bonus, default off)

``decoupled`` (AReaL's correction, off by default) replaces ``s`` with
``min(r_b, tis_cap) * min(r_p * A, clip(r_p) * A)``, ``r_p = pi_theta / pi_prox`` with the proximal
policy the learner's own at the step's start (``r_p`` = 1, gradient ``A * dl``) and ``r_b`` =
``pi_prox / pi_b``: a mismatched engine scales a token's gradient instead of masking it.

The ratio against ``pi_b`` corrects for staleness (b may be up to S versions old). The
truncation is the truncated importance weighting for actor/learner numeric mismatch and stale
samples: where the behaviour engine gave a token a much lower probability than the learner
(r > C) the unclipped branch of the PPO min would scale the gradient by r without bound; it is
capped at C instead (the token still contributes, with weight C). Advantages:
``A_i = R_i - mean(R)`` over the G samples of a prompt, or divided by the group's std too
(``adv_norm``, ``rl/advantages.py``). ``loss_norm="token"`` averages over all
completion tokens of the batch, ``"sequence"`` averages per sequence then over sequences.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echorl.actor import lora
from echorl.actor.types import RolloutGroup
from echorl.rl import precision
from echorl.rl.advantages import group_advantages, zero_variance
from echorl.rl.grpo_config import GRPOConfig, scheduled_entropy, scheduled_lr

__all__ = ["GRPOConfig", "GRPOTrainer", "grpo_token_loss", "scheduled_entropy", "scheduled_lr"]

if TYPE_CHECKING:
    import torch


MAX_LOG_RATIO = 20.0
"""|log π_θ − log π_b| is clamped here before ``exp``: e^20 is far beyond every clip and truncation
(so the loss is unchanged for any sane token) yet far below float32 overflow (e^88)."""


def grpo_token_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: GRPOConfig,
    ref_logp: torch.Tensor | None = None,
    n_tokens: float | None = None,
    n_seqs: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss of a [N, T] block of completion tokens (see the module docstring).

    ``advantages`` is [N] (one per sequence); ``mask`` [N, T] marks real tokens. ``n_tokens``
    / ``n_seqs`` are the batch-wide normalisers when this block is one micro-batch of many
    (default: this block's own counts). ``entropy`` [N, T] (with its graph) is the bonus's, weighted
    by ``entropy_coef`` (default ``cfg.entropy_coef``). Returns the loss and detached statistics.
    """
    import torch

    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)[:, None].expand_as(logp)
    if not cfg.off_policy_correction:
        behaviour_logp = logp.detach()
    ratio = torch.exp(torch.clamp(logp - behaviour_logp, -MAX_LOG_RATIO, MAX_LOG_RATIO))
    if cfg.decoupled:
        surr, trunc = _decoupled_surrogate(logp, ratio.detach(), adv, cfg)
    else:
        clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
        surr = torch.minimum(ratio * adv, clipped * adv)
        trunc = (adv < 0) & (ratio > cfg.tis_cap)
        # value tis_cap * A, gradient tis_cap * A * d logp
        truncated = (cfg.tis_cap / ratio).detach() * ratio * adv
        surr = torch.where(trunc, truncated, surr)
    tok = -surr
    kl = None
    if ref_logp is not None and cfg.kl_coef > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        tok = tok + cfg.kl_coef * kl
    coef = cfg.entropy_coef if entropy_coef is None else entropy_coef
    if entropy is not None and coef > 0:
        tok = tok - coef * entropy
    if cfg.loss_norm == "token":
        denom = float(n_tokens) if n_tokens is not None else float(mask.sum().clamp(min=1))
        loss = (tok * mask).sum() / denom
    else:
        per_seq = (tok * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        denom = float(n_seqs) if n_seqs is not None else float(max(1, logp.shape[0]))
        loss = per_seq.sum() / denom
    with torch.no_grad():
        m = mask.bool()
        n = max(1, int(m.sum()))
        is_clipped = ((ratio > 1 + cfg.clip_high) & (adv > 0)) | ((ratio < 1 - cfg.clip_low) & (adv < 0))
        if cfg.decoupled:  # the clip is against the proximal policy, which the one step never leaves
            is_clipped = torch.zeros_like(is_clipped)
        stats = {
            "ratio_mean": float(ratio[m].sum()) / n,
            "clip_frac": float((is_clipped & m).sum()) / n,
            "tis_frac": float((trunc & m).sum()) / n,
            "kl": float((kl * mask).sum()) / n if kl is not None else 0.0,
        }
    return loss, stats


def _decoupled_surrogate(
    logp: torch.Tensor, behaviour_ratio: torch.Tensor, adv: torch.Tensor, cfg: GRPOConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoupled objective (AReaL): the PPO clip against the proximal policy, weighted by the
    truncated proximal/behaviour ratio. The learner takes one optimizer step per batch, so the
    proximal policy is its own at this forward pass (``logp`` detached: the clipped ratio is 1,
    with the gradient of log π), and ``behaviour_ratio`` = π_prox / π_b. The engine's mismatch
    only scales a token's gradient (capped at ``tis_cap``), never masks it."""
    import torch

    ratio = torch.exp(logp - logp.detach())
    clipped = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    trunc = behaviour_ratio > cfg.tis_cap
    weight = torch.clamp(behaviour_ratio, max=cfg.tis_cap)
    return weight * torch.minimum(ratio * adv, clipped * adv), trunc


def state_dict_finite(state: dict[str, Any]) -> bool:
    """True iff every floating-point tensor of ``state`` is finite."""
    import torch

    return all(
        bool(torch.isfinite(t).all()) for t in state.values() if isinstance(t, torch.Tensor) and t.is_floating_point()
    )


Row = tuple[list[int], list[int], list[float], "list[bool] | None"]
"""One training sequence: prompt ids, completion ids, behaviour log-probs, model mask."""

STAT_KEYS = ("loss", "ratio_mean", "clip_frac", "tis_frac", "kl", "logp_abs_diff", "entropy")
"""Per-step statistics that add up over disjoint shares of a batch (see ``accumulate``)."""


def row_tokens(row: Row) -> int:
    """Completion tokens of ``row`` that count in the loss."""
    _, c, _, m = row
    return len(c) if m is None else sum(map(bool, m))


@dataclass
class Prepared:
    """A validated batch: rows, their advantages, the index of each row's group, all rewards."""

    rows: list[Row] = field(default_factory=list)
    advs: list[float] = field(default_factory=list)
    group_of: list[int] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    groups: int = 0
    zero_var_groups: int = 0
    """groups whose samples all got the same reward: advantage 0, no gradient"""

    @property
    def n_tokens(self) -> float:
        return float(sum(row_tokens(r) for r in self.rows))


class GRPOTrainer:
    """Owns the policy and its optimizer; one :meth:`train_step` = one version.

    ``model`` is a local HF directory or an already built ``PreTrainedModel``. Rewards must be
    set on every group (the learner recomputes them with the task verifier first).
    """

    def __init__(self, model: str | Path | Any, config: GRPOConfig | None = None, version: int = 0) -> None:
        import torch

        self.config = config or GRPOConfig()
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            model = AutoModelForCausalLM.from_pretrained(Path(model), local_files_only=True)
        # fp32 master weights and AdamW state whatever the compute dtype (rl/precision.py)
        master = getattr(torch, precision.master_dtype(self.config.dtype))
        self.model = model.to(device=self.config.device, dtype=master)
        if self.config.lora is not None:  # the base is frozen: only the adapter is trained
            self.model = lora.attach(self.model, self.config.lora)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            lora.trainable(self.model),
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )
        self.ref_model = None  # with LoRA the reference is the base itself (the adapter disabled)
        if self.config.kl_coef > 0 and not lora.is_adapted(self.model):
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self._version = int(version)
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)

    @property
    def version(self) -> int:
        return self._version

    def weights_finite(self) -> bool:
        """True iff every parameter is finite (checked before a version is published or saved)."""
        return state_dict_finite(self.model.state_dict())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the policy weights (for publishing a version and checkpoints).
        A tied ``lm_head.weight`` is the embedding matrix again and is left out (every loader here
        accepts that): for SmolLM2-135M that is 113 MB of a 651 MB fp32 snapshot. With LoRA: the
        adapter's tensors only (a version is the adapter)."""
        if lora.is_adapted(self.model):
            return lora.adapter_state(self.model)
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        return {
            k: v.detach().to("cpu").clone()
            for k, v in self.model.state_dict().items()
            if not (tied and k == "lm_head.weight")
        }

    def published_state(self) -> dict[str, torch.Tensor]:
        """What a published version holds: :meth:`state_dict` in the run's dtype (bf16 copies of
        the fp32 master weights under mixed precision; checkpoints keep the master weights)."""
        return precision.published_copy(self.state_dict(), self.config.dtype)

    def _batch(self, rows: list[Row]) -> tuple[torch.Tensor, ...]:
        """Right-padded input ids, attention mask, completion mask, behaviour log-probs
        (completion positions aligned to the *predicting* position, i.e. shifted by one). A row's
        model mask (episodes: False on environment observations) keeps those tokens out of the
        completion mask, hence out of the loss and its normalisers."""
        import torch

        width = max(len(r[0]) + len(r[1]) for r in rows)
        n = len(rows)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        att = torch.zeros((n, width), dtype=torch.long)
        cmask = torch.zeros((n, width - 1))
        blogp = torch.zeros((n, width - 1))
        for i, (p, c, lp, m) in enumerate(rows):
            ids[i, : len(p) + len(c)] = torch.tensor(p + c)
            att[i, : len(p) + len(c)] = 1
            cmask[i, len(p) - 1 : len(p) - 1 + len(c)] = 1 if m is None else torch.tensor(m, dtype=torch.float32)
            blogp[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(lp)
        dev = self.config.device
        return ids.to(dev), att.to(dev), cmask.to(dev), blogp.to(dev)

    def token_logprobs(self, model: Any, ids: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """log p(ids[:, t+1] | ids[:, :t+1]) for every position, shape [N, T-1]."""
        return self.token_logprobs_entropy(model, ids, att)[0]

    def token_logprobs_entropy(
        self, model: Any, ids: torch.Tensor, att: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """:meth:`token_logprobs`, the (detached) entropy in nats of the sampling distribution
        ``softmax(logits / T)`` at every position, and the entropy bonus's (with its graph; None
        without a bonus), all [N, T-1]."""
        import torch

        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float() / (self.config.temperature or 1.0)
        logp_all = torch.log_softmax(logits, dim=-1)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        bonus = None
        if self.config.entropy_coef > 0 or self.config.entropy_final > 0:
            picked = logits[..., list(self.config.entropy_tokens)] if self.config.entropy_tokens else logits
            logq = torch.log_softmax(picked, dim=-1)
            bonus = -(logq.exp() * logq).sum(-1)
        return logp_all.gather(-1, ids[:, 1:, None]).squeeze(-1), entropy, bonus

    def load_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any], version: int) -> None:
        """Set weights, optimizer state and version (a checkpoint's). A tied ``lm_head.weight``
        may be missing; anything else missing or unexpected is a checkpoint of another model."""
        if lora.is_adapted(self.model):
            lora.load_adapter(self.model, model_state)
        else:
            missing, unexpected = self.model.load_state_dict(model_state, strict=False)
            tied = {"lm_head.weight"} if getattr(self.model.config, "tie_word_embeddings", False) else set()
            if set(missing) - tied or unexpected:
                raise KeyError(f"checkpoint does not fit the model: missing {missing}, unexpected {unexpected}")
        self.optimizer.load_state_dict(optimizer_state)
        self._version = int(version)
        if self.config.kl_refresh:  # a resumed run's magnet is the weights it resumes from
            self.refresh_reference()

    def prepare(self, groups: list[RolloutGroup]) -> Prepared:
        """Validate ``groups`` and turn them into training rows with their advantages."""
        out = Prepared()
        vocab = int(self.model.config.vocab_size)
        for gi, g in enumerate(groups):
            if g.rewards is None or len(g.rewards) != len(g.samples):
                raise ValueError(f"group {g.prompt_id}: rewards missing or wrong length")
            a = group_advantages(g.rewards, self.config.adv_norm, self.config.adv_eps)
            out.rewards.extend(g.rewards)
            out.groups += 1
            out.zero_var_groups += zero_variance(g.rewards)
            for s, adv in zip(g.samples, a):
                if not s.token_ids or not g.prompt_token_ids:
                    continue
                if len(s.logprobs) != len(s.token_ids) or not all(
                    0 <= t < vocab for t in (*g.prompt_token_ids, *s.token_ids)
                ):
                    raise ValueError(f"group {g.prompt_id}: token ids out of range or log-probs misaligned")
                if s.mask is not None and not any(s.mask):
                    continue  # an episode with no model token has nothing to train
                out.rows.append((list(g.prompt_token_ids), list(s.token_ids), list(s.logprobs), s.mask))
                out.advs.append(adv)
                out.group_of.append(gi)
        return out

    def accumulate(self, rows: list[Row], advs: list[float], n_tokens: float, n_seqs: float) -> dict[str, float]:
        """Forward and backward over ``rows`` in micro-batches, adding to the gradients. The
        loss is normalised by the batch-wide ``n_tokens`` / ``n_seqs``, so the gradients of
        disjoint shares of one batch sum to the gradient of the whole batch; so do the returned
        statistics (:data:`STAT_KEYS`)."""
        import torch

        self.model.train()
        sums = dict.fromkeys(STAT_KEYS, 0.0)
        mb, coef = self.config.micro_batch, scheduled_entropy(self.config, self._version)
        for start in range(0, len(rows), mb):
            chunk = rows[start : start + mb]
            ids, att, cmask, blogp = self._batch(chunk)
            with precision.autocast(self.config.device, self.config.dtype):
                logp, entropy, bonus = self.token_logprobs_entropy(self.model, ids, att)
                ref = None
                if self.config.kl_coef > 0:
                    with torch.no_grad(), lora.reference(self.model, self.ref_model) as ref_model:
                        ref = self.token_logprobs(ref_model, ids, att)
            adv = torch.tensor(advs[start : start + mb], device=logp.device)
            loss, st = grpo_token_loss(logp, blogp, adv, cmask, self.config, ref, n_tokens, n_seqs, bonus, coef)
            loss.backward()
            sums["loss"] += float(loss.detach())
            w = float(cmask.sum()) / n_tokens
            for k in ("ratio_mean", "clip_frac", "tis_frac", "kl"):
                sums[k] += st[k] * w
            sums["logp_abs_diff"] += float(((logp.detach() - blogp).abs() * cmask).sum()) / n_tokens
            sums["entropy"] += float((entropy * cmask).sum()) / n_tokens
        return sums

    def finish_step(self, loss: float) -> float | None:
        """Clip the gradients, step the optimizer, count the version; returns the grad norm, or
        None when the loss or a gradient is not finite: then nothing is stepped (the weights and
        the version stay) and the gradients are dropped. With several ranks every rank sees the
        same summed loss and gradients, so all of them decide alike."""
        import torch

        # the global norm is non-finite iff one gradient is; max_norm=inf measures without clipping
        max_norm = self.config.max_grad_norm or float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return None
        lr = scheduled_lr(self.config, self._version)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self._version += 1
        if self.config.kl_refresh and self._version % self.config.kl_refresh == 0:
            self.refresh_reference()
        return grad_norm

    def refresh_reference(self) -> None:
        """Make the current policy the KL reference (``kl_refresh``: the magnet moves)."""
        if self.ref_model is not None:
            self.ref_model.load_state_dict(self.model.state_dict())

    def train_step(self, groups: list[RolloutGroup]) -> dict[str, Any]:
        """One optimizer step on ``groups``; increments :attr:`version` by one, unless the step
        is skipped (``"skipped"`` in the result: "empty" or "nonfinite")."""
        t0 = time.perf_counter()
        prep = self.prepare(groups)
        if not prep.rows:
            return self.skipped("empty", t0)
        self.optimizer.zero_grad(set_to_none=True)
        sums = self.accumulate(prep.rows, prep.advs, prep.n_tokens, float(len(prep.rows)))
        grad_norm = self.finish_step(sums["loss"])
        if grad_norm is None:
            return self.skipped("nonfinite", t0, loss=sums["loss"])
        return self.step_metrics(prep, sums, grad_norm, t0)

    def skipped(self, why: str, t0: float, **extra: float) -> dict[str, Any]:
        """Metrics of a step that was not taken: the version stays, the weights are untouched."""
        return {
            "version": self._version,
            "skipped": why,
            "loss": float("nan"),
            "reward_mean": 0.0,
            "sequences": 0,
            "tokens": 0,
            "grad_norm": 0.0,
            "logp_abs_diff": 0.0,
            "train_seconds": time.perf_counter() - t0,
            "ratio_mean": 0.0,
            "clip_frac": 0.0,
            "tis_frac": 0.0,
            "kl": 0.0,
            "entropy": 0.0,
            "zero_var_group_frac": 0.0,
            "entropy_coef": scheduled_entropy(self.config, self._version),
            **extra,
        }

    def step_metrics(self, prep: Prepared, sums: dict[str, float], grad_norm: float, t0: float) -> dict[str, Any]:
        rewards = prep.rewards
        return {
            "version": self._version,
            "loss": sums["loss"],
            "reward_mean": sum(rewards) / max(1, len(rewards)),
            "sequences": len(prep.rows),
            "tokens": int(prep.n_tokens),
            "grad_norm": grad_norm,
            "logp_abs_diff": sums["logp_abs_diff"],
            "train_seconds": time.perf_counter() - t0,
            "zero_var_group_frac": prep.zero_var_groups / max(1, prep.groups),
            "entropy_coef": scheduled_entropy(self.config, self._version - 1),  # the weight this step used
            **{k: sums[k] for k in ("ratio_mean", "clip_frac", "tis_frac", "kl", "entropy")},
        }

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.config)

    def close(self) -> None:
        """Nothing to release in one process (``DistributedGRPO.close`` stops its worker ranks)."""
