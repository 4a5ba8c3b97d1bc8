"""The learner peer's side of the shared training loop (``rl/loop.py``, built by ``rl/build.py``):
network rollouts as its :class:`~echorl.rl.loop.RolloutSource` (groups arrive through
``LearnerService``, versions leave through the ``Publisher``, which never makes training wait),
and the provisioning rule of architecture §7 with its metrics."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from echorl.protocol.messages import SamplingSpec
from echorl.rl.loop import TrainingLoop

if TYPE_CHECKING:
    from echorl.actor.types import RolloutGroup
    from echorl.learner.publish import BroadcastRecord, Publisher
    from echorl.learner.service import LearnerService

log = logging.getLogger(__name__)


def required_throughput(kappa: int, rollouts_per_update: int, t_train: float, t_bcast: float) -> float | None:
    """Σμ needed so the learner never waits: κR / (κ·T_train − T_bcast); None if unbounded
    (T_bcast ≥ κ·T_train: no node set can keep up without a longer publication period)."""
    denom = kappa * t_train - t_bcast
    return None if denom <= 0 else kappa * rollouts_per_update / denom


def sampling_spec(loop: TrainingLoop) -> SamplingSpec:
    """What every lease asks the nodes to sample with (the loop's one sampling source)."""
    p = loop.sampling_params()
    return SamplingSpec(temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.max_new_tokens, stop=list(p.stop))


class Provisioning:
    """architecture §7: T_train and T_bcast (EMAs) and the throughput Σμ the nodes must supply."""

    def __init__(self, loop: TrainingLoop) -> None:
        self.loop = loop
        self.t_bcast_ema = 0.0

    def on_broadcast(self, rec: BroadcastRecord) -> None:
        """Per completed broadcast: the capacity model's T_bcast (EMA)."""
        self.t_bcast_ema = rec.t_bcast if self.t_bcast_ema == 0 else 0.8 * self.t_bcast_ema + 0.2 * rec.t_bcast

    def metrics(self) -> dict[str, float | None]:
        return {"t_bcast_s": self.t_bcast_ema, "required_rollouts_per_s": self.required_rollouts_per_s()}

    def required_rollouts_per_s(self) -> float | None:
        """The required Σμ from the current EMAs; None while unknown (no step trained yet) or
        unbounded. Read by the service for cost-aware activation."""
        loop = self.loop
        if loop.t_train_ema <= 0:
            return None
        return required_throughput(loop.kappa, loop.settings.prompts_per_step, loop.t_train_ema, self.t_bcast_ema)


class NetworkSource:
    """Rollouts from the joined nodes: wait for accepted submissions; offer versions to the
    publication task; the network's part of each metrics row."""

    def __init__(self, service: LearnerService, publisher: Publisher, provisioning: Provisioning) -> None:
        self.service, self.publisher, self.provisioning = service, publisher, provisioning

    async def wait(self) -> None:
        await self.service.wait_for_submission(1.0)

    async def publish(self, version: int, state_dict: dict[str, Any]) -> None:
        self.publisher.offer(version, state_dict)

    def after_step(self) -> None:
        """Nodes ask for leases themselves (paced by ``StalenessRule.room``)."""

    def step_skipped(self, batch: list[RolloutGroup], why: str) -> None:
        """Counted for status; after a non-finite step the contributors are flagged."""
        self.service.step_skipped(batch, why)

    def metrics(self) -> dict[str, Any]:
        """The network's part of each metrics row: what the service, the publisher and the
        provisioning rule each report."""
        return {**self.service.metrics(), **self.publisher.metrics(), **self.provisioning.metrics()}
