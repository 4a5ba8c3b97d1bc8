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
