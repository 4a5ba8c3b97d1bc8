"""Adapter for ``reasoning-gym`` procedural tasks (optional extra ``tasks``).

``--task reasoning_gym:NAME`` (or ``--task reasoning-gym --task-option dataset=NAME``) trains on
the reasoning-gym generator ``NAME`` (``basic_arithmetic``, ``leg_counting``, ...). Entries are
generated on the fly from ``(seed, index)``, so nothing is downloaded and a prompt is rebuilt
from its index in any process; the verifier is the generator's own ``score_answer`` applied to
the completion's final answer. Tested with ``basic_arithmetic`` (tests/tasks).
"""

from __future__ import annotations

from typing import Any

from .base import Prompt, Task, TaskError
from .checker import extract_final_answer

EVAL_SEED_OFFSET = 1_000_003


class ReasoningGymTask(Task):
    """Options: ``dataset`` (a reasoning-gym generator name), ``size`` (training entries; the
    cursor wraps), ``n_eval`` (held-out entries, another seed), ``seed``, ``max_new_tokens``;
    any other option is passed to the generator's config (e.g. ``max_terms=3``)."""

    name = "reasoning-gym"

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        size: int = 10_000,
        n_eval: int = 200,
        seed: int = 0,
        max_new_tokens: int = 256,
        **generator_options: Any,
    ) -> None:
        super().__init__()
        try:
            import reasoning_gym  # type: ignore[import-not-found]
        except ImportError:
            raise TaskError("reasoning-gym task needs the optional extra: pip install 'echorl[tasks]'") from None
        size, n_eval, max_new_tokens = int(size), int(n_eval), int(max_new_tokens)
        if not 1 <= size <= 10_000_000 or not 1 <= n_eval <= 100_000 or not 1 <= max_new_tokens <= 8192:
            raise TaskError("reasoning-gym: need 1 <= size <= 1e7, 1 <= n_eval <= 1e5, 1 <= max_new_tokens <= 8192")
        try:
            self._splits = {
                "train": reasoning_gym.create_dataset(dataset, size=size, seed=int(seed), **generator_options),
                "eval": reasoning_gym.create_dataset(
                    dataset, size=n_eval, seed=int(seed) + EVAL_SEED_OFFSET, **generator_options
                ),
            }
        except (KeyError, TypeError, ValueError, AssertionError) as exc:
            raise TaskError(
                f"reasoning-gym: cannot create dataset {dataset!r} with {generator_options}: {exc}"
            ) from None
        self.dataset, self.max_new_tokens = dataset, max_new_tokens

    def _prompt(self, pid: str, split: str, idx: int) -> Prompt:
        entry = self._splits[split][idx]
        return Prompt(pid, str(entry["question"]), str(entry["answer"]), {"split": split, "index": idx})

    def prompt_at(self, index: int) -> Prompt:
        return self._prompt(f"{self.name}:{index}", "train", index % len(self._splits["train"]))

    def reward(self, prompt: Prompt, completion_text: str) -> float:
        ds = self._splits.get(str(prompt.meta.get("split")))
        idx = prompt.meta.get("index")
        if ds is None or not isinstance(idx, int) or not 0 <= idx < len(ds):
            raise TaskError(f"reasoning-gym: prompt {prompt.prompt_id!r} has no valid split/index")
        answer = extract_final_answer(completion_text) or completion_text.strip()
        return float(ds.score_answer(answer=answer, entry=ds[idx]))

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(f"{self.name}:eval:{i}", "eval", i) for i in range(len(self._splits["eval"]))]
