"""tinker-cookbook's simplest RL recipe (``tinker_cookbook/recipes/rl_loop.py``, tinker-cookbook
0.6.1), run unmodified against echorl, with an environment that runs here in place of GSM8K.

The recipe's loop (sampling client per batch, ``num_samples`` = group size, centred rewards,
``importance_sampling`` loss on ``target_tokens``/``logprobs``/``advantages``, ``optim_step``, the
final ``save_checkpoint``) is the cookbook's code; what is replaced are its inputs that need the
Hugging Face hub: the dataset (``datasets.load_dataset``: addition problems), the tokenizer (the
served model's, from its directory), the renderer (``a+b=`` prompts, EOS stop) and the grader.
Usage: ``python cookbook_rl.py MODEL_DIR LOG_DIR STEPS`` with ``TINKER_BASE_URL``/``TINKER_API_KEY``.
Prints ``{"start": mean reward of the first half of the batches, "end": of the second half, "rewards": each}``.
"""

import json
import os
import sys

import datasets
from addition_env import max_tokens, problems, prompt_ids, score
from tinker import types
from tinker_cookbook.recipes import rl_loop
from transformers import AutoTokenizer

model_dir, log_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
BATCH, GROUP = 8, 8
tokenizer = AutoTokenizer.from_pretrained(model_dir)


class AdditionRenderer:
    """What rl_loop asks of a renderer, for ``a+b=`` prompts of a character model."""

    def build_generation_prompt(self, convo):
        return types.ModelInput.from_ints(prompt_ids(tokenizer, convo[-1]["content"]))

    def get_stop_sequences(self):
        return [tokenizer.eos_token_id]

    def parse_response(self, tokens):
        return {"role": "assistant", "content": tokenizer.decode(tokens, skip_special_tokens=True)}, True


rows = problems(BATCH * steps, seed=7, tokenizer=tokenizer)
train = datasets.Dataset.from_dict({"question": [q for q, _ in rows], "answer": [a for _, a in rows]})
datasets.load_dataset = lambda *a, **k: datasets.DatasetDict({"train": train})
rl_loop.get_tokenizer = lambda name: tokenizer
rl_loop.model_info.get_recommended_renderer_name = lambda name: "echorl-addition"
rl_loop.renderers.get_renderer = lambda name, tok: AdditionRenderer()
rl_loop.get_reward = lambda completion, answer: score(tokenizer, completion, answer)

config = rl_loop.Config(
    base_url=None,
    log_path=log_dir,
    model_name=os.environ.get("ECHORL_BASE_MODEL", "echorl-tiny"),
    batch_size=BATCH,
    group_size=GROUP,
    learning_rate=float(sys.argv[4]) if len(sys.argv) > 4 else 2e-3,
    lora_rank=8,
    save_every=0,
    max_tokens=max_tokens(tokenizer),
    loss_fn="importance_sampling",
    ttl_seconds=None,
    max_steps=steps,
)
rl_loop.main(config)
with open(f"{log_dir}/metrics.jsonl") as f:
    rewards = [row["reward/total"] for row in map(json.loads, f) if "reward/total" in row]
print(
    json.dumps(
        {
            "client": "tinker",
            "loop": "rl",
            "start": sum(rewards[: len(rewards) // 2]) / max(1, len(rewards) // 2),
            "end": sum(rewards[len(rewards) // 2 :]) / max(1, len(rewards) - len(rewards) // 2),
            "rewards": rewards,
        }
    )
)
