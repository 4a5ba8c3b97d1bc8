"""The vLLM engine's LoRA path as far as the CPU allows (actor/vllm_lora.py): the adapter
directory handed to vLLM is a peft adapter directory that peft itself loads into the same
model the version came from, and the engine is rebuilt with LoRA enabled for the run's rank."""

from __future__ import annotations

import torch

from echorl.actor import lora
from echorl.actor.backend import TorchBackend
from echorl.actor.model import default_model
from echorl.actor.vllm_lora import engine_kwargs, write_adapter_dir

SETTINGS = lora.LoraSettings(rank=4, alpha=8.0)


def test_the_adapter_directory_is_what_peft_loads(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = lora.attach(TorchBackend.from_pretrained(default_model()).model, SETTINGS)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # a trained adapter: B no longer zero
    version = lora.adapter_state(model)
    out = write_adapter_dir(tmp_path / "v3", SETTINGS, version, str(default_model()))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(default_model()), out)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits, atol=1e-5)
    assert engine_kwargs(SETTINGS) == {"enable_lora": True, "max_lora_rank": 4, "max_loras": 1}
