"""Group-relative advantages of GRPO: how a group's rewards become each sample's advantage.

``mean`` (the default, Dr. GRPO): ``A_i = R_i - mean(R)``. ``mean_std`` (the original GRPO):
``A_i = (R_i - mean(R)) / (std(R) + eps)`` with the population std. Dividing by the std makes
every group count the same whatever is at stake in it: with episodic groups that share a deal
(Kuhn poker) a group where one chip separates the samples pushes as hard as one where three
do, and on poker with the shipped model that drives the policy to "always pass"
(docs/learning-notes.md has the measurements that chose the default).
"""

from __future__ import annotations

from typing import Literal, get_args

AdvNorm = Literal["mean", "mean_std"]
"""How a group's rewards are normalised: centred on the group mean, or centred and divided by its std."""
ADV_NORMS: tuple[str, ...] = get_args(AdvNorm)
DEFAULT_ADV_NORM: AdvNorm = "mean"
"""Chosen by measurement (docs/learning-notes.md, "Advantage normalisation")."""
ADV_EPS = 1e-6
"""Added to a group's std before dividing: a group of equal rewards has advantages 0, not 0/0."""


def group_advantages(rewards: list[float], norm: AdvNorm = DEFAULT_ADV_NORM, eps: float = ADV_EPS) -> list[float]:
    """The advantages of the G rewards of one prompt (or one episode seed)."""
    if norm not in ADV_NORMS:
        raise ValueError(f"advantage normalisation must be one of {', '.join(ADV_NORMS)}, got {norm!r}")
    g = len(rewards)
    if g == 0:
        return []
    mean = sum(rewards) / g
    centred = [r - mean for r in rewards]
    if norm == "mean":
        return centred
    std = (sum(c * c for c in centred) / g) ** 0.5
    return [c / (std + eps) for c in centred]


def zero_variance(rewards: list[float]) -> bool:
    """True iff every sample of the group has the same reward: the group carries no gradient."""
    return len(rewards) < 2 or max(rewards) == min(rewards)
