"""Adapter for ``reasoning-gym`` procedural tasks (``"reasoning-gym"``; optional extra).

UNTESTED HERE: reasoning-gym is not installed on the development machine; this follows its
documented API (``reasoning_gym.create_dataset(name, size=, seed=)``, entries with
``question``/``answer``/``metadata``, ``dataset.score_answer(answer=, entry=)``). The import
happens only when the task is created, with a clear error if the package is missing.
"""

from __future__ import annotations

from typing import Any

from .base import Prompt, Task, TaskError
from .checker import extract_final_answer


class ReasoningGymTask(Task):
    """Options: ``dataset`` (a reasoning-gym generator name, e.g. ``"basic_arithmetic"``),
    ``size`` (training entries, cursor wraps), ``n_eval``, ``seed``, ``max_new_tokens``,
    plus any generator option under ``config`` (a dict)."""

    name = "reasoning-gym"

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        size: int = 10_000,
        n_eval: int = 200,
        seed: int = 0,
        max_new_tokens: int = 256,
        config: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        try:
            import reasoning_gym  # type: ignore[import-not-found]
        except ImportError:
            raise TaskError(
                "reasoning-gym task needs the optional extra: pip install 'echorl[tasks]'"
            ) from None
        cfg = dict(config or {})
        self._train = reasoning_gym.create_dataset(dataset, size=int(size), seed=int(seed), **cfg)
        self._eval = reasoning_gym.create_dataset(
            dataset, size=int(n_eval), seed=int(seed) + 1_000_003, **cfg
        )
        self.dataset, self.max_new_tokens = dataset, int(max_new_tokens)
        self._entries: dict[str, tuple[Any, dict[str, Any]]] = {}

    def _prompt(self, pid: str, ds: Any, idx: int) -> Prompt:
        entry = ds[idx]
        self._entries[pid] = (ds, entry)
        return Prompt(pid, str(entry["question"]), str(entry["answer"]), {"index": idx})

    def prompt_at(self, index: int) -> Prompt:
        return self._prompt(f"{self.name}:{index}", self._train, index % len(self._train))

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        ds, entry = self._entries.get(prompt.prompt_id) or (None, None)
        if ds is None:  # prompt created in another process: rebuild the entry from its id
            is_eval = ":eval:" in prompt.prompt_id
            ds = self._eval if is_eval else self._train
            entry = ds[int(prompt.meta.get("index", 0))]
        answer = extract_final_answer(completion_text) or completion_text.strip()
        return float(ds.score_answer(answer=answer, entry=entry))

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(f"{self.name}:eval:{i}", self._eval, i) for i in range(len(self._eval))]
