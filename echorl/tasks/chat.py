"""Prompts in the model's chat template: an instruction-tuned model (SmolLM2-Instruct, Qwen3, …)
answers a task's question the way it was tuned to only when the question comes as a user turn.

:func:`with_chat_template` wraps a single-turn task whose model has a chat template (its
tokenizer's ``chat_template``; ``echorl import-gguf`` keeps the GGUF's) so every prompt's
``text`` is ``apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)``.
The wrapping happens once, where prompts are made: the leases carry the templated text, and the
learner, nodes and actors tokenize it as they tokenize any prompt (the template's special tokens
are in the text, and a tokenizer maps them to their ids). Answers, ids and verifiers are the
task's own; a model without a template, or a multi-turn environment, keeps the task unchanged.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .base import Prompt
from .env import is_episodic


class ChatPrompts:
    """``task`` with each prompt's text in ``tokenizer``'s chat template; everything else
    (cursor, verifier, limits, name) is the task's own."""

    def __init__(self, task: Any, tokenizer: Any) -> None:
        self.task = task
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)

    def chat(self, prompt: Prompt) -> Prompt:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True
        )
        return replace(prompt, text=str(text))

    def prompt_at(self, index: int) -> Prompt:
        return self.chat(self.task.prompt_at(index))

    def next_prompts(self, n: int) -> list[Prompt]:
        return [self.chat(p) for p in self.task.next_prompts(n)]

    def eval_prompts(self) -> list[Prompt]:
        return [self.chat(p) for p in self.task.eval_prompts()]


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def with_chat_template(task: Any, tokenizer: Any, enabled: bool = True) -> Any:
    """``task`` in the model's chat template when ``enabled``, the tokenizer has one and the task
    is single-turn; else ``task`` itself."""
    if not enabled or not has_chat_template(tokenizer) or is_episodic(task):
        return task
    return ChatPrompts(task, tokenizer)
