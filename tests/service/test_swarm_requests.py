"""The swarm's request book without the network (``service/swarm.py``): a request of n samples is
⌈n/G⌉ token-id prompts; accepted groups fill it and it ends with exactly n samples cut to it; a
request past its wait, or pinned to a version no longer the newest, is handed to the server with
what it has; a withdrawn prompt out on a lease does not come back when the lease expires."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from echorl.actor.model import default_model
from echorl.actor.types import RolloutGroup, Sample, SamplingParams
from echorl.protocol.identity import Identity
from echorl.rl.buffer import StalenessBuffer, Verdict
from echorl.service.config import ServeConfig
from echorl.service.engine import Engine, Snapshot
from echorl.service.swarm import Swarm
from echorl.tasks.base import Prompt


@pytest.fixture(scope="module")
def engine():
    return Engine(default_model())


def _swarm(engine, **kw) -> Swarm:
    cfg = ServeConfig(swarm=True, group_size=2, swarm_wait_s=5.0, swarm_lora_rank=4, **kw)
    return Swarm(cfg, engine, Identity.generate())


def _group(prompt: Prompt, tokens: list[list[int]], version: int = 0) -> RolloutGroup:
    samples = [Sample(t, [-0.5] * len(t), "length", "") for t in tokens]
    return RolloutGroup(prompt.prompt_id, "", list(prompt.token_ids or []), samples, version)


def test_a_request_is_token_prompts_filled_by_accepted_groups_and_cut_to_it(engine):
    swarm, ended = _swarm(engine), []
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3, stop=[])

    async def main():
        swarm.submit("r1", [20, 21, 22], 3, params, [], lambda seqs, missing: ended.append((seqs, missing)))
        prompts = swarm.buffer.next_prompts(swarm.queue, 8)
        assert [p.token_ids for p in prompts] == [[20, 21, 22]] * 2  # ⌈3/2⌉ prompts of G = 2
        assert swarm.buffer.offer(_group(prompts[0], [[30, 31, 32, 33], [34]]), 0) == Verdict.ACCEPTED
        assert not ended and len(swarm.buffer) == 0  # consumed, never buffered for a batch
        swarm.buffer.offer(_group(prompts[1], [[35, 36], [37, 38]]), 0)

    trio.run(main)
    ((seqs, missing),) = ended
    assert missing == 0 and [s.tokens for s in seqs] == [[30, 31, 32], [34], [35, 36]]
    assert [s.stop_reason for s in seqs] == ["length", "length", "length"]
    assert not swarm.requests and not swarm.buffer.outstanding


def test_a_request_past_its_wait_or_its_version_goes_to_the_server_with_what_it_has(engine):
    swarm, ended = _swarm(engine), {}
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, stop=[])

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(swarm._expire)
            swarm.submit("slow", [20], 4, params, [], lambda s, m: ended.setdefault("slow", (s, m)))
            prompts = swarm.buffer.next_prompts(swarm.queue, 1)
            swarm.buffer.offer(_group(prompts[0], [[40], [41]]), 0)
            await trio.sleep(6.0)  # past swarm_wait_s
            assert ended["slow"][1] == 2 and len(ended["slow"][0]) == 2
            swarm.submit("old", [20], 2, params, [], lambda s, m: ended.setdefault("old", (s, m)))
            swarm.version += 1  # a newer snapshot was published: exact weights only
            await trio.sleep(1.0)
            assert ended["old"] == ([], 2)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert not swarm.queue.waiting and not swarm.buffer.requeued  # the unleased prompt is gone too


def test_a_withdrawn_prompt_on_a_lease_does_not_come_back():
    buffer = StalenessBuffer(0, consumer=lambda g: None)
    p, q = Prompt("a", "", token_ids=[1]), Prompt("b", "", token_ids=[2])
    buffer.register([p, q])
    buffer.withdraw({"a", "b"})
    buffer.requeue([p])  # its lease expired after the request was finished by the server
    assert not buffer.requeued and not buffer.outstanding
    assert buffer.offer(_group(q, [[3]]), 0) == Verdict.REJECTED_UNKNOWN  # a late group: unpaid
    assert not buffer._withdrawn  # both leases ended: nothing kept


def test_only_the_newest_snapshot_of_the_swarms_shape_is_published_as_a_version(engine):
    swarm = _swarm(engine)
    offered = []
    swarm._publisher = type("P", (), {"offer": lambda self, v, state: offered.append(v)})()
    fits = engine.lora_spec(4, swarm.cfg.lora_alpha, 0, True, True, True)
    other = engine.lora_spec(8, swarm.cfg.lora_alpha, 0, True, True, True)
    tensors = {"w": __import__("torch").zeros(1)}
    swarm.offer(Snapshot(other, tensors, ident=1))
    swarm.offer(Snapshot(fits, tensors, ident=2))
    swarm.offer(Snapshot(fits, tensors, ident=3))
    assert offered == [1, 2] and swarm.version == 2
    assert swarm.version_of(Snapshot(fits, tensors, ident=2)) == 1  # leased no more: not the newest
    assert swarm.version_of(Snapshot(other, tensors, ident=1)) is None
    assert swarm.version_of(Snapshot(None, None)) == 0  # the bare base is version 0
