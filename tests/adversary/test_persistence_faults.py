"""What has to keep working when the learner's surroundings fail: a disk that is full at
checkpoint time (the failure is logged, counted as ``checkpoint_failures``, retried after the
next step, and training continues), and a demoted relay that serves again once its demotion
(8 publications) has expired."""

from __future__ import annotations

import errno
import logging

import numpy as np
import trio
from test_hostile_rollouts import tiny  # noqa: F401 - fixture

from echorl.actor.types import RolloutGroup, Sample
from echorl.broadcast.broadcaster import Broadcaster, NodeInfo
from echorl.net.host import open_host
from echorl.protocol.identity import Identity
from echorl.rl import checkpoint as ck


class FedSource:
    """A rollout source that offers one fabricated group per wait (2 samples, rewards 0 and 1)."""

    def __init__(self, loop, tokenizer) -> None:
        self.loop, self.tok = loop, tokenizer

    async def wait(self) -> None:
        p = self.loop.buffer.next_prompts(self.loop.task, 1)[0]
        ids = list(self.tok(p.text, add_special_tokens=False)["input_ids"])
        samples = [Sample([5, 6], [-1.0, -2.0], "length", "x"), Sample([7, 8], [-1.5, -1.0], "length", "y")]
        self.loop.buffer.offer(
            RolloutGroup(p.prompt_id, p.text, ids, samples, self.loop.version), self.loop.version, [0.0, 1.0]
        )
        await trio.sleep(0)

    async def publish(self, version, state_dict) -> None:
        pass

    def after_step(self) -> None:
        pass

    def metrics(self) -> dict:
        return {}

    def step_skipped(self, batch, why) -> None:
        pass


def test_checkpoint_on_a_full_disk_is_logged_counted_retried_and_training_continues(
    tiny,  # noqa: F811 - the imported fixture
    tmp_path,
    monkeypatch,
) -> None:
    from echorl.rl import build
    from echorl.rl.buffer import StalenessBuffer
    from echorl.rl.config import TrainLocalConfig
    from echorl.rl.grpo import GRPOConfig, GRPOTrainer
    from echorl.rl.loop import TrainingLoop
    from echorl.tasks import load_task

    backend = tiny
    task = load_task("addition", digits=2, seed=0, n_eval=4)
    settings = build.loop_settings(
        TrainLocalConfig(
            staleness=2, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2, steps=5, prompts_per_step=1, seed=3
        )
    )
    loop = TrainingLoop(settings, task, GRPOTrainer(backend.model, GRPOConfig()), StalenessBuffer(2), backend)
    real_save, calls = ck.save_checkpoint, []

    def full_disk(root, grpo, *args, **kw):
        calls.append(grpo.version)
        if len(calls) <= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(root, grpo, *args, **kw)

    monkeypatch.setattr(ck, "save_checkpoint", full_disk)
    errors: list[str] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("echorl").addHandler(handler)
    try:
        trio.run(loop.run, FedSource(loop, backend.tokenizer))
    finally:
        logging.getLogger("echorl").removeHandler(handler)
    assert loop.version == 5  # training went on
    assert calls == [2, 3, 4]  # due at v2: failed; retried after the next step (v3): failed; v4: written
    assert loop.faults["checkpoint_failures"] == 2 and not loop.checkpoint_retry
    assert loop.last_row["checkpoint_failures"] == 2
    assert any("checkpoint v2 failed" in e and "No space left" in e for e in errors), errors
    assert ck.load_checkpoint(tmp_path / "ck").version == 4


def test_demoted_relay_is_interior_again_after_eight_publications() -> None:
    from safetensors.numpy import save

    async def main() -> None:
        identity = Identity.generate()
        async with open_host(identity) as host:
            bc = Broadcaster(
                host, identity, "r", direct=False, announce_timeout_s=0.5, done_timeout_s=0.5, liveness_every_s=0.2
            )
            relay = Identity.generate().peer_id
            nodes = [NodeInfo(relay, True, ())]
            bc._demote[relay] = bc._n_pub + bc.demote_for - 1  # reported by a child, completed: a leaf
            reachable = []
            for v in range(10):
                await bc.publish(v, save({"w": np.full(16, v, dtype=np.float32)}), nodes)
                reachable.append(bc._plans[v].peers and bc.server.states[v].announce.members[0].reachable)
                bc._drop.clear()  # the member never answers here: keep it in the node set
                bc.silence.clear()
            assert reachable == [False] * 8 + [True] * 2

    trio.run(main)
