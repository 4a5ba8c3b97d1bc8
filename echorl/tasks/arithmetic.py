"""Arithmetic in words for a chat model (``"arithmetic"``): the task of the real-model run
(``bench/real_model.py``, README "Train a real model").

Prompt ``"What is 7 + 5?"`` (shown in the model's chat template); reward 1.0 iff the last integer
in the completion is the sum, so "7 + 5 = 12" and "The answer is 12." both score and a rambling
answer cut off at ``max_new_tokens`` does not. The ``max_operand`` × ``max_operand`` problems are
split once, by ``split_seed``, into disjoint training and held-out halves; the held-out set is
``n_eval`` prompts cycling over its problems (each prompt scored on one sampled answer, so
repeats measure the sampling policy, not one lucky draw). SmolLM2-135M-Instruct scores about
0.09 at temperature 1 (64 one-digit problems, docs/lora-notes.md): it knows many sums, but rarely
says only the answer.
"""

from __future__ import annotations

import random
import re

from .base import Prompt, Task, TaskError

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> str | None:
    found = _INT.findall(text)
    return found[-1] if found else None


class ArithmeticTask(Task):
    """``What is a + b?`` with ``a, b`` in ``[0, max_operand)``.

    Options: ``max_operand`` (10: one-digit sums), ``seed`` (training order), ``n_eval`` (500
    held-out prompts), ``split_seed`` (which problems are held out).
    """

    name = "arithmetic"
    max_new_tokens = 12
    stop: list[str] = []

    def __init__(self, max_operand: int = 10, seed: int = 0, n_eval: int = 500, split_seed: int = 0) -> None:
        super().__init__()
        max_operand, n_eval = int(max_operand), int(n_eval)
        if not 2 <= max_operand <= 10**6:
            raise TaskError(f"arithmetic: max_operand must be in 2..1000000, got {max_operand}")
        if not 1 <= n_eval <= 100_000:
            raise TaskError(f"arithmetic: n_eval must be in 1..100000, got {n_eval}")
        self.max_operand, self.seed, self.n_eval = max_operand, int(seed), n_eval
        problems = max_operand * max_operand
        rng = random.Random(int(split_seed))
        held = rng.sample(range(problems), problems // 2) if problems <= 10**6 else []
        self._held_out = [divmod(i, max_operand) for i in held[: max(1, min(len(held), n_eval))]]
        self._held_set = set(held)

    @staticmethod
    def format(a: int, b: int) -> str:
        return f"What is {a} + {b}?"

    def _make(self, pid: str, a: int, b: int) -> Prompt:
        return Prompt(prompt_id=pid, text=self.format(a, b), answer=str(a + b))

    def prompt_at(self, index: int) -> Prompt:
        rng = random.Random(self.seed * 1_000_003 + index)
        while True:
            i = rng.randrange(self.max_operand * self.max_operand)
            if i not in self._held_set:
                a, b = divmod(i, self.max_operand)
                return self._make(f"{self.name}:{index}", a, b)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        return 1.0 if last_integer(completion_text) == prompt.answer else 0.0

    def eval_prompts(self) -> list[Prompt]:
        pairs = self._held_out
        return [self._make(f"{self.name}:eval:{i}", *pairs[i % len(pairs)]) for i in range(self.n_eval)]
