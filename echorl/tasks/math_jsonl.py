"""Math word problems from a user's JSONL file (``"math"``), scored by final-answer checking.

Each line is an object with a question (key ``question``, ``problem`` or ``prompt``) and an
answer (key ``answer``, ``solution`` or ``final_answer``). A GSM8K-style answer
(``"...reasoning... #### 42"``) or a ``\\boxed{}`` solution is reduced to its final answer with
:func:`echorl.tasks.checker.extract_final_answer`. The completion's final answer is extracted
the same way and compared with :func:`echorl.tasks.checker.answers_match`.

Held-out set: ``eval_path`` if given, else the last ``n_eval`` lines of ``path`` (default: 10%,
at least 1), which are then excluded from training. Training prompt ``i`` is line
``order[i % n_train]`` where ``order`` is a seeded permutation, so the cursor can run over
several epochs and prompt ids stay unique.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from .base import Prompt, Task, TaskError
from .checker import extract_final_answer, math_reward

SAMPLE_FILE = Path(__file__).parent / "data" / "math_sample.jsonl"
_Q_KEYS = ("question", "problem", "prompt")
_A_KEYS = ("answer", "solution", "final_answer")


def _read_jsonl(path: Path) -> list[tuple[str, str]]:
    if not path.is_file():
        raise TaskError(f"math: no such file: {path}")
    rows: list[tuple[str, str]] = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(f"math: {path}:{lineno}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TaskError(f"math: {path}:{lineno}: expected an object")
        q = next((obj[k] for k in _Q_KEYS if k in obj), None)
        a = next((obj[k] for k in _A_KEYS if k in obj), None)
        if q is None or a is None:
            raise TaskError(f"math: {path}:{lineno}: needs one of {_Q_KEYS} and one of {_A_KEYS}")
        gold = extract_final_answer(str(a)) if ("####" in str(a) or "\\boxed" in str(a)) else str(a)
        if not gold:
            raise TaskError(f"math: {path}:{lineno}: cannot find a final answer in {a!r}")
        rows.append((str(q), gold.strip()))
    if not rows:
        raise TaskError(f"math: {path} holds no problems")
    return rows


class MathJSONLTask(Task):
    """Options: ``path`` (JSONL, default: the shipped sample), ``eval_path``, ``n_eval``,
    ``seed``, ``template`` (with ``{question}``), ``max_new_tokens``."""

    name = "math"
    stop: list[str] = []

    def __init__(
        self,
        path: str | None = None,
        eval_path: str | None = None,
        n_eval: int | None = None,
        seed: int = 0,
        template: str = "Question: {question}\nAnswer:",
        max_new_tokens: int = 256,
    ) -> None:
        super().__init__()
        if "{question}" not in template:
            raise TaskError("math: template must contain {question}")
        rows = _read_jsonl(Path(path) if path else SAMPLE_FILE)
        if eval_path:
            self._train, self._eval = rows, _read_jsonl(Path(eval_path))
        else:
            k = int(n_eval) if n_eval is not None else max(1, len(rows) // 10)
            if not 1 <= k < len(rows):
                raise TaskError(f"math: n_eval must be in 1..{len(rows) - 1}, got {k}")
            self._train, self._eval = rows[:-k], rows[-k:]
        self.template, self.max_new_tokens = template, int(max_new_tokens)
        self._order = list(range(len(self._train)))
        random.Random(seed).shuffle(self._order)

    def prompt_at(self, index: int) -> Prompt:
        q, gold = self._train[self._order[index % len(self._order)]]
        return Prompt(f"{self.name}:{index}", self.template.format(question=q), gold)

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        return math_reward(completion_text, prompt.answer)

    def eval_prompts(self) -> list[Prompt]:
        return [
            Prompt(f"{self.name}:eval:{i}", self.template.format(question=q), gold)
            for i, (q, gold) in enumerate(self._eval)
        ]
