"""The environment the client-side loops train on: 2-digit addition ``a+b=`` on echorl's tiny
character model (it starts at about 0.3 sampled accuracy: room to learn). Runs in the client's
virtualenv (tinker or logits-sdk), so it imports neither torch nor echorl."""

from __future__ import annotations

import random
import re

PROMPT = re.compile(r"(\d+)\+(\d+)")


def problems(n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (question ``"a+b"``, answer) pairs."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append((f"{a}+{b}", str(a + b)))
    return out


def prompt_text(question: str) -> str:
    a, b = PROMPT.search(question).groups()
    return f"{a}+{b}="


def reward(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer else 0.0
