"""Number guessing (``"guess"``): find a secret digit with higher/lower feedback.

The secret is a digit 0–9 drawn from the episode seed. The prompt is ``G:=``; each model turn is
one character, a guess; the observation is ``<=`` (the secret is lower), ``>=`` (higher) or
``!=`` (not a digit), and a correct guess ends the episode with reward 1. After ``max_turns``
guesses (default 4, enough for binary search over ten digits) the episode ends with reward 0.
A policy that guesses uniformly at random (repeats allowed) finds the secret with probability
1 − 0.9⁴ ≈ 0.344 (:func:`random_success`); binary search always does.
"""

from __future__ import annotations

import random

from .base import EnvStep
from .env import Environment


def random_success(turns: int = 4, digits: int = 10) -> float:
    """Success probability of uniform random guessing (with repeats) in ``turns`` guesses."""
    return 1.0 - (1.0 - 1.0 / digits) ** turns


class GuessNumber(Environment):
    """One game of guess-the-digit (see the module docstring)."""

    name = "guess"
    max_turns = 4
    max_action_tokens = 1
    stop: list[str] = []
    n_eval = 500

    def __init__(self) -> None:
        self.secret = 0

    def reset(self, seed: int) -> str:
        self.secret = random.Random(seed).randrange(10)
        return "G:="

    def step(self, action: str) -> EnvStep:
        if len(action) != 1 or action not in "0123456789":
            return EnvStep(done=False, reward=0.0, observation="!=")
        guess = int(action)
        if guess == self.secret:
            return EnvStep(done=True, reward=1.0)
        return EnvStep(done=False, reward=0.0, observation="<=" if self.secret < guess else ">=")
