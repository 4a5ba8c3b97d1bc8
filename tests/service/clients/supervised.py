"""A supervised loop (forward_backward + optim_step) through an unmodified client, printing one
JSON line per step and a last line ``{"start": …, "end": …}``. Usage (in the client's venv):
``python supervised.py tinker|logits STEPS`` with ``TINKER_BASE_URL``/``TINKER_API_KEY`` (or
``LOGITS_*``) set."""

import json
import os
import sys
import time

client_name, steps = sys.argv[1], int(sys.argv[2])
if client_name == "logits":
    import logits as tinker
    from logits import types
else:
    import tinker
    from tinker import types

from addition_env import problems, prompt_text  # noqa: E402 (after the client choice)

service = tinker.ServiceClient()
training = service.create_lora_training_client(base_model=os.environ.get("ECHORL_BASE_MODEL", "echorl-tiny"), rank=8)
training = training.result() if hasattr(training, "result") else training  # 0.38 returns a future
tokenizer = training.get_tokenizer()


def datum(question: str, answer: str):
    prompt = tokenizer.encode(prompt_text(question), add_special_tokens=False)
    target = tokenizer.encode(answer[::-1], add_special_tokens=False) + [tokenizer.eos_token_id]  # a new skill
    ids = prompt + target
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(target)
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
    )


data = [datum(q, a) for q, a in problems(16, seed=1)]
losses = []
t0 = time.time()
for step in range(steps):
    fwd = training.forward_backward(data, "cross_entropy")
    opt = training.optim_step(types.AdamParams(learning_rate=5e-3))
    loss = fwd.result().metrics["loss:sum"]
    opt.result()
    losses.append(loss)
    print(json.dumps({"step": step, "loss": loss}), flush=True)
print(json.dumps({"client": client_name, "start": losses[0], "end": losses[-1], "seconds": time.time() - t0}))
