"""Prompts in the model's chat template (tasks/chat.py): an instruct model's tokenizer wraps
every single-turn prompt as a user turn; a model without a template keeps the task's text."""

from __future__ import annotations

from echorl.tasks import load_task
from echorl.tasks.chat import ChatPrompts, with_chat_template

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(template: str | None):
    from transformers import AutoTokenizer

    from echorl.actor.model import default_model

    tok = AutoTokenizer.from_pretrained(default_model(), local_files_only=True)
    tok.chat_template = template
    return tok


def test_prompts_come_in_the_chat_template_and_keep_their_answers():
    plain = load_task("addition", seed=1)
    task = with_chat_template(load_task("addition", seed=1), _tokenizer(TEMPLATE))
    assert isinstance(task, ChatPrompts)
    p, q = task.next_prompts(1)[0], plain.next_prompts(1)[0]
    assert p.text == f"<|im_start|>user\n{q.text}<|im_end|>\n<|im_start|>assistant\n"
    assert (p.prompt_id, p.answer) == (q.prompt_id, q.answer) and task.cursor == 1
    assert task.reward(p, q.answer) == 1.0
    assert task.eval_prompts()[0].text.endswith("assistant\n")
    task.seek(5)
    assert task.prompt_at(5).answer == plain.prompt_at(5).answer


def test_no_template_or_an_episode_or_switched_off_leaves_the_task_alone():
    task = load_task("addition")
    assert with_chat_template(task, _tokenizer(None)) is task
    assert with_chat_template(task, _tokenizer(TEMPLATE), enabled=False) is task
    poker = load_task("poker")
    assert with_chat_template(poker, _tokenizer(TEMPLATE)) is poker


def test_arithmetic_scores_the_last_integer_and_holds_out_half_the_sums():
    task = load_task("arithmetic", n_eval=120)
    p = task.next_prompts(1)[0]
    a, b = (int(x) for x in p.text.removeprefix("What is ").removesuffix("?").split(" + "))
    assert p.answer == str(a + b)
    assert task.reward(p, f"{a} + {b} = {a + b}") == 1.0 and task.reward(p, f"The answer is {a + b}.") == 1.0
    assert task.reward(p, f"{a + b} is not right, {a + b + 1}") == 0.0 and task.reward(p, "no idea") == 0.0
    held = {q.text for q in task.eval_prompts()}
    trained = {q.text for q in task.next_prompts(400)}
    assert len(task.eval_prompts()) == 120 and len(held) == 50 and not held & trained
