"""The built-in losses of the Tinker API, per token, summed (never averaged) over a request.

Given a datum's target log-probs ``l`` under the current policy (``log_softmax(logits)`` at each
``target_tokens`` position) and its ``loss_fn_inputs``:

- ``cross_entropy``: ``-w · l`` with ``weights`` ``w`` (1 where absent).
- ``importance_sampling``: ``-r · A`` with ``r = exp(l - logprobs)`` (the sampler's log-probs) and
  ``advantages`` ``A``: the policy gradient corrected for the sampler being another policy.
- ``ppo``: ``-min(r · A, clip(r, lo, hi) · A)`` with ``lo``/``hi`` from ``loss_fn_config``
  ``clip_low_threshold``/``clip_high_threshold`` (default 0.8 / 1.2).

The loss of the request is the sum over every token of every datum (the Tinker convention: the
client scales advantages or weights if it wants a mean). The log-ratio is clamped before ``exp`` as
in :mod:`echorl.rl.grpo` so no input can overflow it. Outputs per datum: ``logprobs`` (``l``) and
``elementwise_loss``; metrics ``loss:sum``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from echorl.rl.grpo import MAX_LOG_RATIO

if TYPE_CHECKING:
    import numpy as np
    import torch

DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
REQUIRED = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}


class LossInputError(ValueError):
    """A datum lacks an input its loss needs (a user error, one line)."""


def _input(inputs: dict[str, np.ndarray], name: str, like: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.as_tensor(inputs[name], dtype=torch.float32, device=like.device)


def check_inputs(loss_fn: str, inputs: dict[str, np.ndarray], index: int) -> None:
    missing = [n for n in REQUIRED[loss_fn] if n not in inputs]
    if missing:
        raise LossInputError(f"datum {index}: {loss_fn} needs loss_fn_inputs {', '.join(missing)}")


def elementwise(
    loss_fn: str, logp: torch.Tensor, inputs: dict[str, np.ndarray], config: dict[str, float]
) -> torch.Tensor:
    """The per-token loss of one datum (``logp``: the target log-probs, shape ``[T]``)."""
    import torch

    if loss_fn == "cross_entropy":
        weights = _input(inputs, "weights", logp) if "weights" in inputs else torch.ones_like(logp)
        return -weights * logp
    adv = _input(inputs, "advantages", logp)
    ratio = torch.exp((logp - _input(inputs, "logprobs", logp)).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    if loss_fn == "importance_sampling":
        return -ratio * adv
    lo = float(config.get("clip_low_threshold", DEFAULT_CLIP_LOW))
    hi = float(config.get("clip_high_threshold", DEFAULT_CLIP_HIGH))
    return -torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
