"""The swarm's request book without the network (``service/swarm.py``): a request of n samples is
⌈n/G⌉ token-id prompts; accepted groups fill it and it ends with exactly n samples cut to it;
requests for another snapshot wait for their turn, which comes when the leased ones are done; a
request past its wait is handed to the server with what it has; a withdrawn prompt out on a lease
does not come back when the lease expires."""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from echorl.actor.model import default_model
from echorl.actor.types import RolloutGroup, Sample, SamplingParams
from echorl.protocol.identity import Identity
from echorl.rl.buffer import StalenessBuffer, Verdict
from echorl.service.config import ServeConfig
from echorl.service.engine import Engine, Snapshot
from echorl.service.swarm import KEEP_SNAPSHOTS, Swarm
from echorl.tasks.base import Prompt


@pytest.fixture(scope="module")
def engine():
    return Engine(default_model())


class Published:
    """The publisher's side: versions offered, in order."""

    def __init__(self) -> None:
        self.versions: list[int] = []

    def offer(self, version, state) -> None:
        self.versions.append(version)


def _swarm(engine, **kw) -> Swarm:
    cfg = ServeConfig(swarm=True, group_size=2, swarm_wait_s=5.0, swarm_lora_rank=4, **kw)
    swarm = Swarm(cfg, engine, Identity.generate())
    swarm._publisher, swarm._snaps[0] = Published(), {}
    return swarm


def _snap(engine, ident: int, rank: int = 4) -> Snapshot:
    return Snapshot(engine.lora_spec(rank, 32.0, 0, True, True, True), {"w": torch.zeros(1)}, ident=ident)


BASE = Snapshot(None, None)


def _service_with_nodes(any_active: bool):
    """What ``Swarm.takes`` reads of its lease service: whether any node is active."""
    peers = type("Peers", (), {"has_active": lambda self: any_active})()
    return type("Service", (), {"peers": peers})()


def _group(prompt: Prompt, tokens: list[list[int]], version: int = 0) -> RolloutGroup:
    samples = [Sample(t, [-0.5] * len(t), "length", "") for t in tokens]
    return RolloutGroup(prompt.prompt_id, "", list(prompt.token_ids or []), samples, version)


def test_a_request_is_token_prompts_filled_by_accepted_groups_and_cut_to_it(engine):
    swarm, ended = _swarm(engine), []
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3, stop=[])

    async def main():
        swarm.submit("r1", BASE, [20, 21, 22], 3, params, [], lambda seqs, missing: ended.append((seqs, missing)))
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


def test_a_request_past_its_wait_goes_to_the_server_with_what_it_has(engine):
    swarm, ended = _swarm(engine), {}
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, stop=[])

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(swarm._expire)
            swarm.submit("slow", BASE, [20], 4, params, [], lambda s, m: ended.setdefault("slow", (s, m)))
            prompts = swarm.buffer.next_prompts(swarm.queue, 1)
            swarm.buffer.offer(_group(prompts[0], [[40], [41]]), 0)
            await trio.sleep(6.0)  # past swarm_wait_s
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert ended["slow"][1] == 2 and len(ended["slow"][0]) == 2
    assert not swarm.queue.waiting and not swarm.buffer.requeued  # the unleased prompt is gone too


def test_sessions_snapshots_take_turns_as_the_newest_version(engine):
    swarm, ended = _swarm(engine), []
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, stop=[])
    a, b = _snap(engine, 1), _snap(engine, 2)

    async def main():
        swarm.offer(a)  # nothing leased: published at once (nodes load it before its requests)
        assert (swarm.version, swarm.current, swarm._publisher.versions) == (1, 1, [1])
        swarm.submit("a1", a, [20], 2, params, [], lambda s, m: ended.append(("a1", m)))
        swarm.offer(b)  # a1 is leased at v1: b waits for its turn
        assert swarm.version == 1 and b.ident in swarm._snaps
        swarm.submit("b1", b, [21], 2, params, [], lambda s, m: ended.append(("b1", m)))
        swarm.submit("a2", a, [22], 2, params, [], lambda s, m: ended.append(("a2", m)))  # behind b1: fair
        leased = swarm.buffer.next_prompts(swarm.queue, 8)
        assert [p.token_ids for p in leased] == [[20]]
        swarm.buffer.offer(_group(leased[0], [[30], [31]], version=1), 1)  # a1 done: b's turn
        assert (swarm.version, swarm.current, swarm._publisher.versions) == (2, 2, [1, 2])
        leased = swarm.buffer.next_prompts(swarm.queue, 8)
        assert [p.token_ids for p in leased] == [[21]]
        swarm.buffer.offer(_group(leased[0], [[32], [33]], version=2), 2)  # b1 done: a's turn again
        assert (swarm.version, swarm.current) == (3, 1)
        assert [p.token_ids for p in swarm.buffer.next_prompts(swarm.queue, 8)] == [[22]]

    trio.run(main)
    assert ended == [("a1", 0), ("b1", 0)] and swarm.counters["turns"] == 3


def test_a_withdrawn_prompt_on_a_lease_does_not_come_back():
    buffer = StalenessBuffer(0, consumer=lambda g: None)
    p, q = Prompt("a", "", token_ids=[1]), Prompt("b", "", token_ids=[2])
    buffer.register([p, q])
    buffer.withdraw({"a", "b"})
    buffer.requeue([p])  # its lease expired after the request was finished by the server
    assert not buffer.requeued and not buffer.outstanding
    assert buffer.offer(_group(q, [[3]]), 0) == Verdict.REJECTED_UNKNOWN  # a late group: unpaid
    assert not buffer._withdrawn  # both leases ended: nothing kept


def test_the_swarm_takes_only_what_it_can_sample_exactly(engine):
    swarm = _swarm(engine)
    swarm.service = _service_with_nodes(True)
    ok = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8, stop=["x"])
    swarm.offer(_snap(engine, 1))
    swarm.offer(_snap(engine, 2, rank=8))  # another adapter shape: never published
    assert swarm._publisher.versions == [1]
    assert swarm.takes(_snap(engine, 1), [1, 2], ok, None, False) and swarm.takes(BASE, [1], ok, None, False)
    assert not swarm.takes(_snap(engine, 2, rank=8), [1], ok, None, False)
    assert not swarm.takes(_snap(engine, 1), [1], ok, 7, False)  # a seed: the client expects it to repeat
    assert not swarm.takes(_snap(engine, 1), [1], ok, None, True)  # prompt log-probs
    hot = SamplingParams(temperature=0.7, top_p=1.0, max_new_tokens=8, stop=[])
    assert not swarm.takes(_snap(engine, 1), [1], hot, None, False)  # the spot check replays one temperature
    long = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=swarm.cfg.swarm_max_tokens + 1, stop=[])
    assert not swarm.takes(_snap(engine, 1), [1], long, None, False)
    swarm.service = _service_with_nodes(False)
    assert not swarm.takes(_snap(engine, 1), [1], ok, None, False)  # no node: the server


def test_snapshots_are_bounded_but_never_one_a_request_names(engine):
    swarm = _swarm(engine, queue_size=3)
    swarm.service = _service_with_nodes(True)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, stop=[])

    async def main():
        swarm.offer(_snap(engine, 1))
        swarm.submit("r", _snap(engine, 1), [20], 2, params, [], lambda s, m: None)  # leased at v1
        for ident in range(2, 2 + KEEP_SNAPSHOTS + 5):
            swarm.offer(_snap(engine, ident))
        assert 1 in swarm._snaps and len(swarm._snaps) == KEEP_SNAPSHOTS
        swarm.offer(_snap(engine, 30))
        assert swarm.takes(_snap(engine, 30), [21], params, None, False)
        swarm.submit("s", _snap(engine, 30), [21], 2, params, [], lambda s, m: None)
        swarm.submit("t", _snap(engine, 30), [21], 2, params, [], lambda s, m: None)
        assert not swarm.takes(_snap(engine, 30), [21], params, None, False)  # queue_size requests out

    trio.run(main)
