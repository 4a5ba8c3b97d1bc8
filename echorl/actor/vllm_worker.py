"""The part of the vLLM engine that runs inside vLLM's worker process (``worker_extension_cls``).

vLLM mixes this class into its GPU worker; the node's :class:`~echorl.actor.vllm_backend.VLLMBackend`
calls its methods by name with ``LLM.collective_rpc``. A string method name and a file path are
all that cross the process boundary: the weights travel as a safetensors file (on ``/dev/shm``
where there is one), never pickled, and vLLM's own ``load_weights`` maps Hugging Face names onto
its fused parameters (qkv, gate/up) and copies them in place, so no CUDA graph or KV cache is
rebuilt. Nothing here imports vLLM, so the module imports (and is tested) without it.

UNTESTED against a real vLLM: no GPU or vLLM on the development machine; tests drive it with a
stand-in worker (``tests/actor/fake_vllm.py``).
"""

from __future__ import annotations

from typing import Any


class EchoWorkerExtension:
    """Methods vLLM adds to its worker (``self`` is the worker: it has ``model_runner``)."""

    def echorl_load_weights_file(self, path: str) -> int:
        """Load every tensor of the safetensors file at ``path`` into the running model in place;
        returns how many tensors were handed to the model."""
        from safetensors.torch import load_file

        tensors = load_file(path, device="cpu")
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        model.load_weights(weights=iter(tensors.items()))
        return len(tensors)


#: the dotted name vLLM is given (``LLM(worker_extension_cls=...)``)
EXTENSION = f"{__name__}.{EchoWorkerExtension.__name__}"
