"""Rollout plane: inference backends and sampling with per-token behaviour log-probabilities.

- ``types.py``: ``SamplingParams``, ``Sample``, ``RolloutGroup`` (what a backend returns).
- ``backend.py``: ``InferenceBackend`` (the interface), ``TorchBackend`` (any HF causal LM).
- ``vllm_backend.py``: ``VLLMBackend`` (GPU engine; imported only when chosen).
- ``model.py``: the default tiny model, built locally and cached (``build_default_model``).
- ``worker.py``: actor worker processes of ``echorl train-local``.
- ``gguf_import.py``: ``echorl import-gguf`` (a GGUF file → an HF model directory).
"""
