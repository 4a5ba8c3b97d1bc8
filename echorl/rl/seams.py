"""The types at the RL core's seams: what the loop, the buffer's scorers and the learner peer ask
of the objects handed to them, as :class:`typing.Protocol` classes (a Hugging Face tokenizer, the
GRPO trainer or its data-parallel wrapper), so no hand-off is typed ``Any``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from echorl.actor.types import RolloutGroup
    from echorl.rl.grpo import GRPOConfig


class Tokenizer(Protocol):
    """What the learner asks of a Hugging Face tokenizer: encode a prompt, decode a completion,
    the EOS id(s)."""

    eos_token_id: int | list[int] | None

    def __call__(self, text: str, *, add_special_tokens: bool = ...) -> Any: ...

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = ...) -> str: ...


class Trainer(Protocol):
    """``GRPOTrainer`` and ``DistributedGRPO`` (``rl/distributed.py``): the same interface."""

    @property
    def version(self) -> int: ...

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def config(self) -> GRPOConfig: ...

    def train_step(self, groups: list[RolloutGroup]) -> dict[str, Any]: ...

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The master weights (checkpoints)."""

    def published_state(self) -> dict[str, torch.Tensor]:
        """The weights a published version holds (the run's dtype)."""

    def config_dict(self) -> dict[str, Any]: ...

    def load_state(
        self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any], version: int
    ) -> None: ...

    def close(self) -> None: ...


class MetricsSink(Protocol):
    """Where a metrics row goes besides the JSON-lines file (``common/metrics_sinks.py``)."""

    def write(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...
