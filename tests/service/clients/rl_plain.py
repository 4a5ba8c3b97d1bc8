"""The cookbook's minimal RL loop (``tinker_cookbook/recipes/rl_loop.py``) written against the
client's public API alone, for logits-sdk (tinker 0.21, which the cookbook does not support):
per batch a sampling client from the current weights, ``num_samples`` = group size, centred
rewards, ``importance_sampling`` on ``target_tokens``/``logprobs``/``advantages``, one
``optim_step``. Usage: ``python rl_plain.py logits|tinker MODEL_DIR STEPS LR``. Prints
``{"start": mean reward of the first 3 batches, "end": of the last 3, "half_start"/"half_end": of
each half}``."""

import json
import os
import sys

from transformers import AutoTokenizer

client_name, model_dir, steps, lr = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
if client_name == "logits":
    import logits as tinker
    from logits import types
else:
    import tinker
    from tinker import types

from addition_env import max_tokens, problems, prompt_ids, score  # noqa: E402 (after the client choice)

BATCH, GROUP = 8, 8
tokenizer = AutoTokenizer.from_pretrained(model_dir)
service = tinker.ServiceClient()
training = service.create_lora_training_client(base_model=os.environ.get("ECHORL_BASE_MODEL", "echorl-tiny"), rank=8)
training = training.result() if hasattr(training, "result") else training
rows = problems(BATCH * steps, seed=7, tokenizer=tokenizer)
rewards = []
for step in range(steps):
    sampler = training.save_weights_and_get_sampling_client()
    sampler = sampler.result() if hasattr(sampler, "result") else sampler
    batch = rows[step * BATCH : (step + 1) * BATCH]
    # seeded per batch (the service's sampling is counter-based): the run repeats exactly, so the
    # test's 'reward rises' is one figure (0.245 -> 0.370), not a draw (unseeded: +0.047..+0.099)
    # (ECHORL_UNSEEDED=1: no seed, so that `echorl serve --swarm` leases them to nodes: it never
    # leases a seeded request, whose samples the client expects to repeat)
    seed = None if os.environ.get("ECHORL_UNSEEDED") else 1000 + step
    params = types.SamplingParams(max_tokens=max_tokens(tokenizer), stop=[tokenizer.eos_token_id], seed=seed)
    prompts = [types.ModelInput.from_ints(prompt_ids(tokenizer, q)) for q, _ in batch]
    futures = [sampler.sample(prompt=p, num_samples=GROUP, sampling_params=params) for p in prompts]
    data, batch_rewards = [], []
    for future, prompt, (_, answer) in zip(futures, prompts, batch):
        seqs = future.result().sequences
        group = [score(tokenizer, tokenizer.decode(s.tokens, skip_special_tokens=True), answer) for s in seqs]
        batch_rewards.append(sum(group) / len(group))
        mean = sum(group) / len(group)
        for seq, r in zip(seqs, group):
            if r == mean:
                continue
            ob = prompt.length - 1
            model_input = prompt.append(types.EncodedTextChunk(tokens=seq.tokens[:-1]))
            n = model_input.length
            data.append(
                types.Datum(
                    model_input=model_input,
                    loss_fn_inputs={
                        "target_tokens": [0] * ob + list(seq.tokens),
                        "logprobs": [0.0] * ob + list(seq.logprobs),
                        "advantages": [0.0] * ob + [r - mean] * (n - ob),
                    },
                )
            )
    if data:
        fwd = training.forward_backward(data, "importance_sampling")
        opt = training.optim_step(types.AdamParams(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8))
        fwd.result()
        opt.result()
    rewards.append(sum(batch_rewards) / len(batch_rewards))
    print(json.dumps({"step": step, "reward": rewards[-1]}), flush=True)
half = len(rewards) // 2
first, second = sum(rewards[:half]) / max(1, half), sum(rewards[half:]) / max(1, len(rewards) - half)
out = {"start": sum(rewards[:3]) / 3, "end": sum(rewards[-3:]) / 3, "half_start": first, "half_end": second}
print(json.dumps({"client": client_name, "loop": "rl", **out}))
