"""The environment the client-side loops train on: 2-digit addition ``a+b=`` on echorl's tiny
character model (it starts at about 0.3 sampled accuracy: room to learn); for a model with a chat
template (SmolLM2-135M-Instruct), one-digit sums asked in it, ``What is 7 + 5?``, scored on the
last integer of the answer (echorl's ``arithmetic`` task; SmolLM2 starts near 0.1). Runs in the
client's virtualenv (tinker or logits-sdk), so it imports neither torch nor echorl."""

from __future__ import annotations

import random
import re

PROMPT = re.compile(r"(\d+)\+(\d+)")


def chat(tokenizer) -> bool:
    """Whether the model speaks in a chat template (then the one-digit chat form is used)."""
    return bool(getattr(tokenizer, "chat_template", None))


def problems(n: int, seed: int, tokenizer=None) -> list[tuple[str, str]]:
    """``n`` (question ``"a+b"``, answer) pairs: 2-digit operands, 1-digit for a chat model."""
    rng = random.Random(seed)
    low, high = (0, 9) if tokenizer is not None and chat(tokenizer) else (10, 99)
    out = []
    for _ in range(n):
        a, b = rng.randint(low, high), rng.randint(low, high)
        out.append((f"{a}+{b}", str(a + b)))
    return out


def prompt_text(question: str) -> str:
    a, b = PROMPT.search(question).groups()
    return f"{a}+{b}="


def reward(completion: str, answer: str) -> float:
    return 1.0 if completion.strip() == answer else 0.0


def max_tokens(tokenizer) -> int:
    """A completion's budget: the digits and EOS; a chat model's sentence ("7 + 5 = 12.")."""
    return 12 if chat(tokenizer) else 6


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The prompt's token ids: ``a+b=`` as is, or ``What is a + b?`` in the chat template."""
    if not chat(tokenizer):
        return tokenizer.encode(prompt_text(question), add_special_tokens=False)
    a, b = PROMPT.search(question).groups()
    messages = [{"role": "user", "content": f"What is {a} + {b}?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def score(tokenizer, completion: str, answer: str) -> float:
    """:func:`reward` for the character model; the last integer for a chat model."""
    if not chat(tokenizer):
        return reward(completion, answer)
    found = re.findall(r"-?\d+", completion)
    return 1.0 if found and found[-1] == answer else 0.0
