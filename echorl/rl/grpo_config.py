"""The GRPO learner's hyper-parameters (:class:`GRPOConfig`, built from a run's settings by
``rl/build.py``) and the ones that change over the run's steps (:func:`scheduled_lr`,
:func:`scheduled_entropy`; ``rl/schedules.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from echorl.actor import lora
from echorl.rl.advantages import ADV_EPS, ADV_NORMS, DEFAULT_ADV_NORM, AdvNorm
from echorl.rl.schedules import SCHEDULES, Schedule, anneal


@dataclass
class GRPOConfig:
    """Hyper-parameters of the GRPO learner."""

    lr: float = 5e-4
    """AdamW learning rate (0 leaves the weights untouched)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """'cosine': the rate falls from ``lr`` to ``lr_min_ratio`` × ``lr`` over ``lr_steps`` steps
    (:func:`scheduled_lr`); 'constant': ``lr`` throughout."""
    lr_min_ratio: float = 0.1
    """The cosine schedule's last rate as a fraction of ``lr``."""
    lr_steps: int = 0
    """Optimizer steps the cosine schedule spans (the run's steps; 0: constant)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    clip_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + clip_high."""
    tis_cap: float = 2.0
    """Truncation C of the importance weight pi_theta/pi_b in the unclipped (A < 0) branch."""
    off_policy_correction: bool = True
    """Ratio and truncation against the behaviour policy pi_b (False: the ratio is taken against
    the current policy itself, r = 1 with the gradient of log pi: plain on-policy policy
    gradient that ignores staleness; the ablation of bench/staleness_sweep.py)."""
    decoupled: bool = False
    """The decoupled correction (AReaL): clip against the proximal policy (the learner's own at the
    step's start), weight each token by min(π_prox / π_b, ``tis_cap``) (see :func:`_decoupled_surrogate`)."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to a frozen copy of the initial model (0 = no reference)."""
    kl_refresh: int = 0
    """Copy the current policy into the KL reference after every this many optimizer steps (a moving
    magnet, as magnetic mirror descent's; 0: the initial model throughout). Full fine-tuning only."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus: ``- entropy_coef · H(π_θ(·|prefix))`` per completion token."""
    entropy_schedule: Schedule = "constant"
    """The bonus's weight over ``lr_steps`` steps: from ``entropy_coef`` to ``entropy_final``
    ('linear', 'cosine'; :func:`scheduled_entropy`) or ``entropy_coef`` throughout ('constant')."""
    entropy_final: float = 0.0
    """The scheduled bonus's weight at the last step."""
    entropy_tokens: tuple[int, ...] = ()
    """The bonus's entropy over these token ids only, renormalised (a task's legal one-token
    actions: it widens the choice between them without moving mass onto anything else); empty:
    over the whole vocabulary."""
    loss_norm: Literal["token", "sequence"] = "token"
    """'token': mean over all completion tokens; 'sequence': per-sequence mean, then mean."""
    adv_norm: AdvNorm = DEFAULT_ADV_NORM
    """'mean': rewards centred on the group mean (Dr. GRPO); 'mean_std': also divided by the group's std."""
    adv_eps: float = ADV_EPS
    """Added to the group std before dividing."""
    temperature: float = 1.0
    """Sampling temperature the actors used; logits are divided by it (0 treated as 1)."""
    max_grad_norm: float | None = 1.0
    """Global gradient-norm clip (None = off)."""
    micro_batch: int = 256
    """Sequences per forward/backward pass (gradients accumulate over micro-batches)."""
    device: str = "cpu"
    """Torch device of the learner."""
    dtype: str = "float32"
    """Torch dtype of the compute and of the published versions (``actor/device.py`` picks bfloat16 on
    CUDA by default); a half dtype keeps fp32 master weights and optimizer state (``rl/precision.py``)."""
    lora: lora.LoraSettings | None = None
    """Train a LoRA adapter over the frozen model (``actor/lora.py``); None: full fine-tuning."""

    def __post_init__(self) -> None:
        if self.loss_norm not in ("token", "sequence"):
            raise ValueError(f"loss_norm must be 'token' or 'sequence', got {self.loss_norm!r}")
        if self.adv_norm not in ADV_NORMS:
            raise ValueError(f"adv_norm must be one of {', '.join(ADV_NORMS)}, got {self.adv_norm!r}")
        if self.lr < 0 or self.clip_low < 0 or self.clip_high < 0 or self.tis_cap < 1:
            raise ValueError("lr, clip_low, clip_high must be >= 0 and tis_cap >= 1")
        if self.micro_batch < 1:
            raise ValueError("micro_batch must be >= 1")
        if self.lr_schedule not in ("constant", "cosine") or not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ValueError("lr_schedule must be 'constant' or 'cosine' and lr_min_ratio in [0, 1]")
        if self.entropy_schedule not in SCHEDULES or min(self.entropy_coef, self.entropy_final, self.kl_refresh) < 0:
            raise ValueError(f"entropy_schedule must be one of {SCHEDULES}; entropy weights and kl_refresh >= 0")
        if self.kl_refresh and (self.lora is not None or self.kl_coef <= 0):
            raise ValueError("kl_refresh needs kl_coef > 0 and full fine-tuning (a LoRA run's reference is its base)")
        self.lora = lora.LoraSettings.of(self.lora)  # a worker rank gets it as a dict


def scheduled_lr(cfg: GRPOConfig, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based: the trainer's version before it).
    Cosine: ``lr`` at step 0, ``lr_min_ratio`` × ``lr`` from step ``lr_steps`` − 1 on. A function of
    the step alone, so a resumed run goes on where it was without scheduler state."""
    return anneal(cfg.lr_schedule, cfg.lr, cfg.lr * cfg.lr_min_ratio, step, cfg.lr_steps)


def scheduled_entropy(cfg: GRPOConfig, step: int) -> float:
    """The entropy bonus's weight at optimizer step ``step`` (``entropy_schedule``)."""
    return anneal(cfg.entropy_schedule, cfg.entropy_coef, cfg.entropy_final, step, cfg.lr_steps)
