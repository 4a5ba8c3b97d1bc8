"""The rest of the API a training script uses, through an unmodified client: forward, sampling
options (n, max tokens, temperature, stop strings, seed, prompt log-probs), save_state /
load_state, a training client from a checkpoint (with its optimizer), named sampler weights and a
sampling client from their path, an unsupported option failing in one line. Usage:
``python features.py tinker|logits``; prints one JSON object of findings."""

import json
import os
import sys

client_name = sys.argv[1]
if client_name == "logits":
    import logits as tinker
    from logits import types
else:
    import tinker
    from tinker import types


def done(x):
    return x.result() if hasattr(x, "result") else x


found = {}
service = tinker.ServiceClient()
training = done(
    service.create_lora_training_client(base_model=os.environ.get("ECHORL_BASE_MODEL", "echorl-tiny"), rank=4)
)
tok = training.get_tokenizer()
ids = tok.encode("12+30=42", add_special_tokens=False) + [tok.eos_token_id]
datum = types.Datum(
    model_input=types.ModelInput.from_ints(ids[:-1]),
    loss_fn_inputs={"target_tokens": ids[1:], "weights": [0.0] * 5 + [1.0] * 3},
)
fwd = done(training.forward([datum], "cross_entropy"))
found["forward_logprobs_len"] = len(fwd.loss_fn_outputs[0]["logprobs"].data)
before = fwd.metrics["loss:sum"]
done(training.forward_backward([datum], "cross_entropy"))
done(training.optim_step(types.AdamParams(learning_rate=1e-2)))
state = done(training.save_state("ckpt")).path
found["state_path"] = state
saved = done(training.forward([datum], "cross_entropy")).metrics["loss:sum"]
done(training.forward_backward([datum], "cross_entropy"))
done(training.optim_step(types.AdamParams(learning_rate=1e-2)))
done(training.load_state(state))  # back to the saved weights
after_load = done(training.forward([datum], "cross_entropy")).metrics["loss:sum"]

sampler_path = done(training.save_weights_for_sampler("s1")).path
tinker_path = sampler_path.replace("echorl://", "tinker://", 1)
sampler = done(service.create_sampling_client(model_path=tinker_path))
prompt = types.ModelInput.from_ints(tok.encode("12+30=", add_special_tokens=False))
params = types.SamplingParams(max_tokens=5, temperature=0.7, stop=["2"], seed=3)
res = done(sampler.sample(prompt=prompt, num_samples=3, sampling_params=params, include_prompt_logprobs=True))
again = done(sampler.sample(prompt=prompt, num_samples=3, sampling_params=params))
found["n"] = len(res.sequences)
found["seeded_repeat_equal"] = [s.tokens for s in res.sequences] == [s.tokens for s in again.sequences]
found["logprobs_match_tokens"] = all(len(s.logprobs) == len(s.tokens) for s in res.sequences)
found["stopped_at_string"] = all(
    s.stop_reason == "stop" and tok.decode(s.tokens).endswith(("2", tok.eos_token)) for s in res.sequences
)
found["prompt_logprobs"] = res.prompt_logprobs is not None and res.prompt_logprobs[0] is None
try:
    done(sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2, top_k=5)))
    found["top_k_error"] = None
except Exception as exc:  # the client raises; the message is the server's one line
    found["top_k_error"] = str(exc).splitlines()[0][:300]
if client_name == "tinker":
    resumed = done(service.create_training_client_from_state_with_optimizer(state))
    found["resumed_loss"] = done(resumed.forward([datum], "cross_entropy")).metrics["loss:sum"]
found["losses"] = {"before": before, "saved": saved, "after_load": after_load}
print(json.dumps(found))
