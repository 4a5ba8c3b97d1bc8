"""The submission checks as one ordered table (``learner/checks.py``): docs/protocol.md lists the
rows in the table's order with their codes; the first refusing row answers and is counted; a new
check is one row (its counter appears, its refusal settles the lease and stops the later rows)."""

from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from swarm import capability, signed_submit

from echorl.learner import checks
from echorl.learner.config import ServiceFields
from echorl.learner.pace import PROVEN_LEASES
from echorl.learner.service import LearnerService, PeerRecord
from echorl.net.host import RequestContext
from echorl.protocol import routes
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Lease, LeaseRequest
from echorl.rl.buffer import StalenessBuffer

RUN = "echorl-demo"  # what swarm.signed_submit names
DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def _doc_items() -> list[str]:
    """The numbered items of docs/protocol.md's submit check order."""
    text = DOCS.read_text()
    block = text[text.index("The learner checks a Submit in this order") :].split("\n\n", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\d+\. (.*?)(?=^\d+\. |\Z)", block, re.M | re.S)]


def test_docs_list_the_checks_in_table_order_with_their_codes():
    items = _doc_items()
    assert len(items) == len(checks.CHECKS)
    for i, (row, item) in enumerate(zip(checks.CHECKS, items), 1):
        codes = {code.value for code in row.counters}
        assert codes <= set(re.findall(r"`([a-z_]+)`", item)), f"item {i} ({row.name}) lacks {codes}"


def test_counters_come_from_the_table():
    named = {c for row in checks.CHECKS for c in row.counters.values() if c}
    svc = _service(None)
    assert set(svc.checks.counters) == named | {"signatures_verified"}
    assert named <= set(svc.counters) and named <= set(svc.status().learner)


@pytest.fixture(scope="module")
def tiny():
    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import build_default_model

    return TorchBackend.from_pretrained(build_default_model(warmup=None))


def _service(tiny, version=lambda: 0, settings: ServiceFields | None = None) -> LearnerService:
    from echorl.tasks import load_task

    task = load_task("addition", digits=2, seed=0)
    settings = settings or ServiceFields(group_size=2, prompts_per_lease=2, prompts_per_step=2, staleness=2)
    vocab = int(tiny.model.config.vocab_size) if tiny is not None else 100
    tokenizer = tiny.tokenizer if tiny is not None else None
    return LearnerService(
        Identity.generate(), RUN, task, tokenizer, StalenessBuffer(2, task.reward), settings, vocab, version=version
    )


async def _leased(svc: LearnerService, me: Identity, version: int = 0) -> tuple[RequestContext, Lease]:
    cap = capability()
    now = time.monotonic()
    svc.peers.add(PeerRecord(me.peer_id, cap, now, now, version=version))
    ctx = RequestContext(peer_id=me.peer_id, protocol=routes.SUBMIT, received_at=time.time())
    lease = await svc.on_lease(LeaseRequest(run_id=RUN, version=version, max_prompts=2), ctx)
    assert isinstance(lease, Lease), lease
    return ctx, lease


async def _refusal(svc: LearnerService, msg, ctx) -> ErrorCode:
    with pytest.raises(ProtocolError) as err:
        await svc.on_submit(msg, ctx)
    return err.value.code


def test_the_first_refusing_row_answers_counts_and_settles(tiny):
    """A submission both stale and not matching its lease is refused by the earlier row (staleness,
    7) with its code, counted once, and its lease settled with the prompts re-queued."""
    t = [0]

    async def main():
        svc = _service(tiny, version=lambda: t[0])
        svc.note_published(0)
        me = Identity.generate()
        ctx, lease = await _leased(svc, me)
        t[0] = 5  # the learner moved on: v0 is now 5 > S = 2 versions old
        bad = signed_submit(me, lease, 0, token_ids=(4,) * 99, logprobs=(-1.0,) * 99)  # too long, too
        assert await _refusal(svc, bad, ctx) == ErrorCode.STALE_VERSION
        assert svc.counters[checks.STALE] == 1 and svc.counters[checks.INVALID] == 0
        assert not svc.leases.active and len(svc.buffer.requeued) == len(lease.prompts)

    trio.run(main)


def test_a_new_check_is_one_row(tiny, monkeypatch):
    """One row inserted before the groups check: its counter appears, its refusal answers the node,
    settles the lease (prompts re-queued) and the rows after it never run."""
    ran: list[str] = []

    async def no_odd_nonces(self, sub):
        ran.append("custom")
        if sub.msg.nonce[0] % 2:
            raise ProtocolError(ErrorCode.BAD_ROLLOUT, "odd nonce")

    async def groups(self, sub):
        ran.append("groups")
        raise AssertionError("a later row ran")

    table = list(checks.CHECKS)
    at = [row.name for row in table].index("groups")
    custom = checks.Check("odd", no_odd_nonces, {ErrorCode.BAD_ROLLOUT: "submissions_rejected_odd"}, "", "odd nonce")
    table[at : at + 1] = [custom, checks.Check("groups", groups, table[at].counters, "", table[at].doc)]
    monkeypatch.setattr(checks, "CHECKS", tuple(table))

    async def main():
        svc = _service(tiny)
        svc.note_published(0)
        me = Identity.generate()
        ctx, lease = await _leased(svc, me)
        msg = signed_submit(me, lease, 0)
        while not msg.nonce[0] % 2:  # an odd first nonce byte
            msg = signed_submit(me, lease, 0)
        assert svc.counters["submissions_rejected_odd"] == 0
        assert await _refusal(svc, msg, ctx) == ErrorCode.BAD_ROLLOUT
        assert svc.counters["submissions_rejected_odd"] == 1 and ran == ["custom"]
        assert not svc.leases.active and len(svc.buffer.requeued) == len(lease.prompts)

    trio.run(main)


def test_a_second_submission_for_a_lease_under_check_is_refused_unchecked(tiny, monkeypatch):
    """While one submission for a lease is in its (slow) checks, a second one for the same lease is
    refused at once (`replay`) without running any later row; the claim ends with the first."""
    ran: list[str] = []

    async def slow(self, sub):
        ran.append("slow")
        await trio.sleep(0.3)

    table = list(checks.CHECKS)
    at = [row.name for row in table].index("lease") + 1
    table.insert(at, checks.Check("slow", slow, {ErrorCode.BAD_ROLLOUT: "submissions_rejected_slow"}, "", "slow"))
    monkeypatch.setattr(checks, "CHECKS", tuple(table))

    async def main():
        svc = _service(tiny)
        svc.note_published(0)
        me = Identity.generate()
        ctx, lease = await _leased(svc, me)
        first: list[object] = []

        async def submit_first():
            try:
                first.append(await svc.on_submit(signed_submit(me, lease, 0), ctx))
            except ProtocolError as exc:
                first.append(exc.code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit_first)
            await trio.sleep(0.05)  # the first is in the slow row now
            with trio.fail_after(0.2):  # refused before the first's check ends
                assert await _refusal(svc, signed_submit(me, lease, 0), ctx) == ErrorCode.REPLAY
        assert ran == ["slow"] and len(first) == 1
        assert not svc.leases._checking  # released however the first ended

    trio.run(main)


def test_a_service_whose_versions_wait_for_its_leases_gives_them_no_staleness_horizon():
    """``echorl serve --swarm`` publishes no version while a lease is out: the pace of its versions
    (seconds apart when a client saves twice) must not cut a lease's deadline, as it does a GRPO
    learner's (there a result past the staleness bound is worthless)."""

    async def deadline(holds: bool) -> float:
        from echorl.tasks import load_task

        task = load_task("addition", digits=2, seed=0)
        settings = ServiceFields(group_size=2, prompts_per_lease=2, prompts_per_step=2, staleness=0)
        svc = LearnerService(
            Identity.generate(), RUN, task, None, StalenessBuffer(0), settings, 100, holds_versions=holds
        )
        svc.admission.pace.note_version(0, 100.0)
        svc.admission.pace.note_version(1, 100.5)  # two versions half a second apart
        svc.note_published(1)
        _, lease = await _leased(svc, Identity.generate(), version=1)
        return lease.deadline_s

    short, full = trio.run(deadline, False), trio.run(deadline, True)
    assert short < 3.0 <= ServiceFields().lease_min_s + 1.0 < full


def test_the_checks_of_many_submissions_share_a_few_worker_threads(tiny, monkeypatch):
    """The checks' worker threads hold the GIL against the trio loop: a burst of submissions runs
    its checks in ``CHECK_THREADS`` threads, not one each (at 1,000 peers, up to trio's 40 made
    the loop wake 0.1-0.3 s late and leases wait seconds)."""
    import threading

    running, most, lock = [0], [0], threading.Lock()
    verify = checks.wire.verify

    def slow_verify(msg, peer_id):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return verify(msg, peer_id)

    monkeypatch.setattr(checks.wire, "verify", slow_verify)

    trio.run(_burst, tiny, 8)
    assert most[0] == checks.CHECK_THREADS == 2


async def _burst(tiny, n: int) -> None:
    """``n`` proven peers each submit a lease's answer at the same moment; all are accepted."""
    svc = _service(tiny, settings=ServiceFields(group_size=2, prompts_per_lease=2, prompts_per_step=64))
    svc.note_published(0)
    peers = [Identity.generate() for _ in range(n)]
    for me in peers:  # proven workers: the newcomer budget would lease only some of them
        svc.peers.add(PeerRecord(me.peer_id, capability(), time.monotonic(), time.monotonic()))
        svc.peers.load(me.peer_id).on_time_in_row = PROVEN_LEASES
    leased = [await _leased(svc, me) for me in peers]
    async with trio.open_nursery() as nursery:
        for me, (ctx, lease) in zip(peers, leased):
            nursery.start_soon(svc.on_submit, signed_submit(me, lease, 0), ctx)
    assert svc.submissions["submissions_accepted"] == n


def test_a_small_submission_is_verified_and_converted_on_the_loop_a_large_one_in_a_thread(tiny, monkeypatch):
    """A thread hand-off costs the loop more than a small body's checks (``INLINE_CHECK_BYTES``):
    the signature and conversion of a ~650-byte submission run on the loop's thread; a body over
    the limit, or of unknown size, has them in a worker thread; the reward is always a thread's."""
    import threading

    where: dict[str, list[bool]] = {"verify": [], "convert": [], "score": []}
    verify, convert = checks.wire.verify, checks.convert_submission

    def on_loop(name, fn):
        def wrapped(*args, **kwargs):
            where[name].append(threading.current_thread() is threading.main_thread())
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(checks.wire, "verify", on_loop("verify", verify))
    monkeypatch.setattr(checks, "convert_submission", on_loop("convert", convert))

    async def main():
        svc = _service(tiny, settings=ServiceFields(group_size=2, prompts_per_lease=2, prompts_per_step=64))
        monkeypatch.setattr(svc.buffer, "score", on_loop("score", svc.buffer.score))
        svc.note_published(0)
        for size in (700, checks.INLINE_CHECK_BYTES + 1, None):
            me = Identity.generate()
            ctx, lease = await _leased(svc, me)
            msg = signed_submit(me, lease, 0)
            await svc.on_submit(msg, replace(ctx, body_bytes=size))
        assert svc.submissions["submissions_accepted"] == 3

    trio.run(main)
    assert where == {"verify": [True, False, False], "convert": [True, False, False], "score": [False] * 3}


def test_a_burst_of_submissions_is_checked_in_turns(tiny, monkeypatch):
    """trio runs every ready task each round: a burst of submissions checked at once made each
    round long and a lease wait for all of them. The rows up to the spot check take turns: of 8
    submissions at once, at most ``CHECK_TURNS`` are in them together, and all 8 are accepted."""
    inside, most = [0], [0]
    member = checks.SubmitChecks.still_member

    async def slow_member(self, sub):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        await trio.sleep(0.02)
        inside[0] -= 1
        await member(self, sub)

    monkeypatch.setattr(
        checks, "CHECKS", tuple(replace(r, run=slow_member) if r.name == "member" else r for r in checks.CHECKS)
    )

    trio.run(_burst, tiny, 8)
    assert most[0] == checks.CHECK_TURNS == 4
