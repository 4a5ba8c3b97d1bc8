"""StalenessBuffer: acceptance boundaries, re-queue of rejected and expired prompts, idempotency."""

from __future__ import annotations

import pytest

from echorl.actor.types import RolloutGroup, Sample
from echorl.rl.buffer import StalenessBuffer, Verdict
from echorl.tasks import load_task


def _group(pid: str, version: int) -> RolloutGroup:
    return RolloutGroup(pid, "1+1=", [4, 75, 4, 83], [Sample([5, 1], [-0.5, -0.1], "stop", "2")] * 2, version)


@pytest.mark.parametrize("S", [0, 1, 4])
def test_acceptance_boundary(S):
    task = load_task("addition")
    for t in range(0, 8):
        for b in range(0, 8):
            buf = StalenessBuffer(S)
            p = buf.next_prompts(task, 1)[0]
            v = buf.offer(_group(p.prompt_id, b), current_version=t)
            if b > t:
                assert v is Verdict.REJECTED_INVALID
            elif t - b <= S:
                assert v == "accepted" and len(buf) == 1
            else:
                assert v is Verdict.REJECTED_STALE and buf.rollouts_rejected_stale == 1
                assert buf.requeued[0] == p  # prompt goes back to the queue


def test_rejected_prompts_are_served_again_first_and_rescored():
    task = load_task("addition")
    buf = StalenessBuffer(1, scorer=task.reward)
    first = buf.next_prompts(task, 3)
    assert buf.offer(_group(first[0].prompt_id, 0), 5) is Verdict.REJECTED_STALE
    again = buf.next_prompts(task, 2)
    assert again[0] == first[0] and again[1].prompt_id == "addition:3"
    g = _group(first[1].prompt_id, 5)
    g.rewards = [1.0, 1.0]  # actor's hint is ignored
    assert buf.offer(g, 5) is Verdict.ACCEPTED
    assert g.rewards == [task.reward(first[1], "2")] * 2


def test_duplicates_and_unknown_results_are_not_counted_twice():
    task = load_task("addition")
    buf = StalenessBuffer(2)
    p = buf.next_prompts(task, 1)[0]
    assert buf.offer(_group(p.prompt_id, 0), 0) is Verdict.ACCEPTED
    assert buf.offer(_group(p.prompt_id, 0), 0) is Verdict.REJECTED_UNKNOWN
    assert buf.offer(_group("never-leased", 0), 0) is Verdict.REJECTED_UNKNOWN
    assert buf.rollouts_rejected_unknown == 2 and len(buf) == 1


def test_expired_lease_requeue_then_late_result_discarded():
    task = load_task("addition")
    buf = StalenessBuffer(0)
    ps = buf.next_prompts(task, 2)
    buf.requeue(ps)
    assert list(buf.requeued) == ps and not buf.outstanding
    assert buf.offer(_group(ps[0].prompt_id, 0), 0) is Verdict.REJECTED_UNKNOWN
    assert [p.prompt_id for p in buf.next_prompts(task, 3)] == ["addition:0", "addition:1", "addition:2"]


def test_take_rechecks_staleness_and_tracks_stats():
    task = load_task("addition")
    buf = StalenessBuffer(2)
    ps = buf.next_prompts(task, 4)
    for p, b in zip(ps, [1, 2, 3, 3]):
        assert buf.offer(_group(p.prompt_id, b), 3) is Verdict.ACCEPTED
    assert buf.take(5, 3) is None and len(buf) == 4  # not enough: kept
    # the version moved to 4 while they waited: b=1 is now stale (4-1 > 2), b=2 is at the edge
    batch = buf.take(2, 4)
    assert [g.behaviour_version for g in batch] == [2, 3]
    assert buf.rollouts_rejected_stale == 1 and [p.prompt_id for p in buf.requeued] == [ps[0].prompt_id]
    assert buf.rollouts_accepted == 2 and buf.staleness_max == 2 and buf.staleness_mean == 1.5
    assert {p.prompt_id for p in buf.pending_prompts()} == {ps[0].prompt_id, ps[3].prompt_id}


def test_bad_staleness():
    with pytest.raises(ValueError):
        StalenessBuffer(-1)


def test_score_outside_then_offer_uses_those_rewards():
    task = load_task("addition")
    buf = StalenessBuffer(2, scorer=task.reward)
    ps = buf.next_prompts(task, 2)
    groups = [_group(ps[0].prompt_id, 0), _group("never-leased", 0)]
    rewards = buf.score(groups)  # what the learner runs in a worker thread
    assert rewards == [[task.reward(ps[0], "2")] * 2, None]
    groups[0].rewards = [9.0, 9.0]  # the actor's hint never counts
    assert buf.offer(groups[0], 0, rewards[0]) is Verdict.ACCEPTED and groups[0].rewards == rewards[0]
    assert buf.offer(groups[1], 0, rewards[1]) is Verdict.REJECTED_UNKNOWN


def test_a_group_its_queue_would_let_go_stale_is_refused_at_acceptance_not_dropped_after():
    """Receipts only for work that trains (issue 24): once batches are taken, a group offered
    behind enough others that its batch would come after it went stale is refused now (its
    prompt re-queued, nothing credited), not accepted and dropped later by ``take``."""
    task = load_task("addition")
    buf = StalenessBuffer(1)
    ps = buf.next_prompts(task, 6)
    for p in ps[:2]:
        assert buf.offer(_group(p.prompt_id, 0), 0) is Verdict.ACCEPTED
    assert buf.trains_at(0) == 0  # no batch taken yet: trained at the current version
    assert buf.take(2, 0) is not None  # step 0 is training: the next batch trains at version 1
    assert buf.trains_at(0) == 1
    assert buf.offer(_group(ps[2].prompt_id, 0), 0) is Verdict.ACCEPTED  # batch at v1: staleness 1
    assert buf.offer(_group(ps[3].prompt_id, 0), 0) is Verdict.ACCEPTED
    assert buf.offer(_group(ps[4].prompt_id, 0), 0) is Verdict.REJECTED_STALE  # its batch: v2, staleness 2
    assert buf.requeued[-1] == ps[4] and buf.rollouts_rejected_stale == 1
    assert buf.offer(_group(ps[5].prompt_id, 1), 1) is Verdict.ACCEPTED  # v1's own group is fresh at v2
    assert buf.take(2, 1) is not None and buf.take(1, 2) is not None
    assert buf.rollouts_dropped_stale == 0 and buf.staleness_max == 1


def test_groups_ahead_that_will_be_dropped_do_not_delay_a_group():
    """A group ahead in the queue that is stale by the time its batch comes is dropped then and
    takes no place in a batch, so it does not push the groups behind it later."""
    task = load_task("addition")
    buf = StalenessBuffer(1)
    ps = buf.next_prompts(task, 5)
    assert buf.offer(_group(ps[0].prompt_id, 0), 0) is Verdict.ACCEPTED
    assert buf.take(1, 0) is not None  # batches of one
    for p in ps[1:3]:  # accepted at v1 (fresh now); the second one's batch is at v2: refused
        buf.offer(_group(p.prompt_id, 0), 1)
    assert len(buf) == 1 and buf.rollouts_rejected_stale == 1
    assert buf.offer(_group(ps[3].prompt_id, 1), 1) is Verdict.ACCEPTED  # batch at v2
    # at v2 the b=0 group ahead is stale (dropped, no place): only the b=1 group is ahead, so a
    # group offered now trains at v3, not v4 (where a b=2 group would be stale)
    assert buf.trains_at(2) == 3
    assert buf.offer(_group(ps[4].prompt_id, 2), 2) is Verdict.ACCEPTED


def test_a_buffer_told_its_batch_size_predicts_from_the_start():
    """The learner's buffer knows B from its config: before any batch is drawn the trainer waits
    at the current version, so the first B groups train there and the next B one version later."""
    task = load_task("addition")
    buf = StalenessBuffer(0, batch=2)
    ps = buf.next_prompts(task, 3)
    assert [buf.offer(_group(p.prompt_id, 0), 0) for p in ps] == [Verdict.ACCEPTED] * 2 + [Verdict.REJECTED_STALE]


class _FullScans(StalenessBuffer):
    """The same buffer, forgetting what earlier calls scanned: every call scans it all."""

    def trains_at(self, current_version: int) -> int:
        self._scan = None
        return super().trains_at(current_version)

    def take(self, n: int, current_version: int) -> list[RolloutGroup] | None:
        self._checked = (-1, 0)
        return super().take(n, current_version)


def test_resumed_scans_answer_what_full_scans_answer_through_offers_takes_and_drops():
    """``trains_at`` and ``take`` resume where earlier calls stopped (full scans per submission
    were 19 % of the learner's CPU at 1,000 peers); through random offers, takes, drops and version
    changes they answer, drop and re-queue exactly what full scans do."""
    import random

    rng = random.Random(7)
    tasks = (load_task("addition"), load_task("addition"))
    bufs = (StalenessBuffer(2, batch=3), _FullScans(2, batch=3))
    version = 0

    def same() -> None:
        a, b = bufs
        assert a.trains_at(version) == b.trains_at(version)
        assert a.buffered_ids() == b.buffered_ids() and list(a.requeued) == list(b.requeued)
        assert (a.rollouts_dropped_stale, a.rollouts_accepted) == (b.rollouts_dropped_stale, b.rollouts_accepted)

    for _ in range(800):
        op = rng.random()
        if op < 0.55:
            ((p,), (q,)) = (buf.next_prompts(t, 1) for buf, t in zip(bufs, tasks))
            assert p == q  # re-queued prompts first, in the same order
            bv = max(0, version - rng.randrange(4))
            assert len({buf.offer(_group(p.prompt_id, bv), version) for buf in bufs}) == 1
        elif op < 0.75:
            n = rng.choice((3, 3, 50))  # 50: too few, the stale are still dropped
            got = [buf.take(n, version) for buf in bufs]
            assert [None if g is None else [x.prompt_id for x in g] for g in got].count(None) in (0, 2)
        elif op < 0.85 and len(bufs[0]):
            pid = rng.choice(bufs[0].buffered_ids())
            assert bufs[0].drop([pid]) == bufs[1].drop([pid]) == 1
        else:
            version += rng.randrange(2)
        same()
