"""The lease-grant pace (``learner/grants.py``): no faster than the loop checks the results."""

from __future__ import annotations

import pytest

from echorl.learner import grants
from echorl.learner.grants import GrantPace


def test_a_crowd_asking_at_once_is_granted_a_burst_then_spread_one_slot_apart():
    """1,000 askers at the same instant: a second's worth of grants at the prior cost's rate, the
    rest deferred to distinct slots ``1 / rate`` apart, none beyond ``MAX_WAIT_S``; coming back at
    their slots they are granted at the bucket's rate, not all at once."""
    pace = GrantPace(cpu=lambda: 0.0)
    rate = grants.UTILIZATION / grants.PRIOR_COST_S
    waits = [pace.wait_s(100.0) for _ in range(1000)]
    granted = [w for w in waits if w == 0]
    assert len(granted) == int(rate * grants.BURST_S)
    deferred = sorted(w for w in waits if w > 0)
    assert pace.deferred == len(deferred) == 1000 - len(granted)
    gaps = [b - a for a, b in zip(deferred, deferred[1:])]
    assert min(gaps) == pytest.approx(1 / rate) and max(deferred) <= grants.MAX_WAIT_S
    # each comes back at its slot: granted at about the bucket's rate
    back = sorted(100.0 + w for w in deferred)
    again = [pace.wait_s(t) for t in back[: int(rate * 5)]]
    assert sum(w == 0 for w in again) >= 0.9 * len(again)


def test_the_rate_follows_the_loop_s_measured_cost_per_submission():
    """Over a window of ``MEASURE_S`` with enough submissions, the loop's CPU per submission
    replaces the prior: 2 ms each allows 2.5 × the grants of 5 ms; a window of a few submissions
    leaves the estimate alone (fixed work would count as their cost)."""
    cpu = [0.0]
    pace = GrantPace(cpu=lambda: cpu[0])
    assert pace.rate == pytest.approx(grants.UTILIZATION / grants.PRIOR_COST_S)
    pace.wait_s(0.0)  # opens the first window
    for _ in range(500):
        pace.note_submission()
    cpu[0] = 1.0  # 2 ms of the loop a submission
    pace.wait_s(grants.MEASURE_S + 0.1)
    assert pace.cost_s == pytest.approx(0.002)
    assert pace.rate == pytest.approx(grants.UTILIZATION / 0.002)
    for _ in range(grants.MIN_MEASURED - 1):
        pace.note_submission()
    cpu[0] = 3.0  # 20 ms each over too few: not taken
    pace.wait_s(2 * grants.MEASURE_S + 0.2)
    assert pace.cost_s == pytest.approx(0.002)
    assert pace.metrics()["lease_grants_per_s_max"] == round(grants.UTILIZATION / 0.002)
    for _ in range(grants.MIN_MEASURED):
        pace.note_submission()
    cpu[0] = 1000.0  # a loop busy with refused requests: each accepted one looks dear, within bounds
    pace.wait_s(3 * grants.MEASURE_S + 0.3)
    assert pace.cost_s == grants.COST_RANGE[1] and pace.rate > 1


def test_at_a_steady_rate_below_capacity_nobody_waits():
    """A fleet asking at half the bucket's rate, evenly, is never deferred."""
    pace = GrantPace(cpu=lambda: 0.0)
    step = 2 / pace.rate
    assert all(pace.wait_s(10.0 + i * step) == 0 for i in range(2000))
    assert pace.deferred == 0


def test_the_learner_defers_a_lease_the_bucket_cannot_serve_and_grants_it_at_its_slot():
    """In the service: with the bucket spent, a proven peer's lease request is answered
    ``paced`` with its slot as ``retry_after_s`` (no prompt leaves the buffer); asking again at
    that slot it gets its lease."""
    import time

    import trio
    from swarm import capability

    from echorl.learner.config import ServiceFields
    from echorl.learner.pace import PROVEN_LEASES
    from echorl.learner.service import LearnerService, PeerRecord
    from echorl.net.host import RequestContext
    from echorl.protocol import routes
    from echorl.protocol.identity import Identity
    from echorl.protocol.messages import Lease, LeaseDeferred, LeaseRequest
    from echorl.rl.buffer import StalenessBuffer
    from echorl.tasks import load_task

    async def main():
        task = load_task("addition", digits=2, seed=0)
        settings = ServiceFields(group_size=2, prompts_per_lease=2, prompts_per_step=64)
        svc = LearnerService(
            Identity.generate(), "echorl-demo", task, None, StalenessBuffer(2, task.reward), settings, 100
        )
        svc.note_published(0)
        me = Identity.generate()
        svc.peers.add(PeerRecord(me.peer_id, capability(), time.monotonic(), time.monotonic()))
        svc.peers.load(me.peer_id).on_time_in_row = PROVEN_LEASES
        ctx = RequestContext(peer_id=me.peer_id, protocol=routes.LEASE, received_at=time.time())
        ask = LeaseRequest(run_id="echorl-demo", version=0, max_prompts=2)
        while svc.admission.grants.wait_s(time.monotonic()) == 0:  # a burst of grants spends the bucket
            pass
        before = svc.buffer.outstanding.copy()
        reply = await svc.on_lease(ask, ctx)
        assert isinstance(reply, LeaseDeferred) and reply.reason == "paced"
        assert 0 < reply.retry_after_s <= 3 / svc.admission.grants.rate  # the slot after the burst's last asker
        assert svc.buffer.outstanding == before and svc.admission.metrics()["leases_deferred_by_grant_pace"] == 2
        await trio.sleep(reply.retry_after_s + 0.01)
        assert isinstance(await svc.on_lease(ask, ctx), Lease)

    trio.run(main)
