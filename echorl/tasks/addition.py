"""Multi-digit addition: the demo's default task (``"addition"``).

Prompt ``"12+34="``, expected completion ``"46"`` followed by EOS. Reward 1.0 for the exact
sum (surrounding whitespace ignored), else 0.0. Training prompt ``i`` is a deterministic
function of ``(seed, i)``; the held-out set is a fixed list of pairs that training (and the
default model's warm-up) never uses.
"""

from __future__ import annotations

import random

from .base import Prompt, Query, Task, TaskError, TurnPolicy

EVAL_SEED = 987_654_321


class AdditionTask(Task):
    """``a+b=`` with ``a, b`` uniform in ``[0, 10**digits)``.

    Options: ``digits`` (default 2), ``seed`` (training prompt order, default 0),
    ``n_eval`` (held-out prompts, default 1024: sampled accuracy on it has a standard error of ~0.015).
    """

    name = "addition"
    stop: list[str] = []

    def __init__(self, digits: int = 2, seed: int = 0, n_eval: int = 1024) -> None:
        super().__init__()
        digits, n_eval = int(digits), int(n_eval)
        if not 1 <= digits <= 9:
            raise TaskError(f"addition: digits must be in 1..9, got {digits}")
        space = (10**digits) ** 2
        if not 1 <= n_eval <= space // 4:
            raise TaskError(f"addition: n_eval must be in 1..{space // 4}, got {n_eval}")
        self.digits, self.seed, self.n_eval = digits, int(seed), n_eval
        self.max_new_tokens = digits + 3  # sum has at most digits+1 chars, + EOS, + slack
        rng = random.Random(EVAL_SEED + digits)
        pairs: list[tuple[int, int]] = []
        seen: set[tuple[int, int]] = set()
        while len(pairs) < n_eval:
            pair = (rng.randrange(10**digits), rng.randrange(10**digits))
            if pair not in seen:
                seen.add(pair)
                pairs.append(pair)
        self._eval_pairs = pairs
        self._eval_set = seen

    @staticmethod
    def format(a: int, b: int) -> str:
        return f"{a}+{b}="

    def _make(self, pid: str, a: int, b: int) -> Prompt:
        return Prompt(prompt_id=pid, text=self.format(a, b), answer=str(a + b))

    def sample_pair(self, rng: random.Random) -> tuple[int, int]:
        """A training pair drawn from ``rng`` (never one of the held-out pairs)."""
        while True:
            pair = (rng.randrange(10**self.digits), rng.randrange(10**self.digits))
            if pair not in self._eval_set:
                return pair

    def prompt_at(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + index)
        a, b = self.sample_pair(rng)
        return self._make(f"{self.name}:{index}", a, b)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        return 1.0 if completion_text.strip() == prompt.answer else 0.0

    def eval_prompts(self) -> list[Prompt]:
        return [self._make(f"{self.name}:eval:{i}", a, b) for i, (a, b) in enumerate(self._eval_pairs)]

    def exact_eval(self, prompts: list[Prompt], policy: TurnPolicy) -> float:
        """Mean probability of the exact sum followed by EOS: the expected accuracy of one sample
        (a padded answer, which the verifier also accepts, is not counted)."""
        probs = policy.probs([Query((p.text,), p.answer, True) for p in prompts])
        return sum(probs) / max(1, len(probs))
