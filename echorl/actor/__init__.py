"""Rollout plane: inference backends and sampling with per-token behaviour log-probabilities.

- ``types.py``: ``SamplingParams``, ``Sample``, ``RolloutGroup`` (what a backend returns).
- ``backend.py``: ``InferenceBackend`` (the interface), ``TorchBackend`` (any HF causal LM).
- ``vllm_backend.py``: ``VLLMBackend`` (GPU engine; imported only when chosen).
- ``model.py``: the default tiny model, built locally and cached (``build_default_model``).
- ``worker.py``: actor worker processes of ``echorl train-local``.
- ``lora.py``: LoRA adapters through peft (train, publish, apply, base digest; ``LoraSettings``).
- ``vllm_lora.py``: adapter versions on the vLLM engine (untested without a GPU).
- ``gguf_import.py``: ``echorl import-gguf`` (a GGUF file → an HF model directory).
"""
