"""Cost-aware activation (architecture §7, learner/activation.py) and its use by the learner's lease
handler: the pure policy, and ``on_lease`` deferring a standby node — no network."""

from __future__ import annotations

import time

import pytest
import trio

from echorl.learner.activation import NodeOffer, choose_active, preemption_margin
from echorl.learner.config import ServiceFields
from echorl.learner.service import LearnerService, PeerRecord
from echorl.net.host import RequestContext
from echorl.protocol import wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import Capability, Lease, LeaseDeferred, LeaseRequest
from echorl.rl.buffer import StalenessBuffer


def offer(pid: str, price: float, mu: float, measured: bool = True) -> NodeOffer:
    return NodeOffer(pid, price, mu, measured)


def test_cheapest_set_meets_requirement_with_margin() -> None:
    nodes = [
        offer("a", 4.0, 1.0),  # 4.0 per unit
        offer("b", 1.0, 1.0),  # 1.0 per unit
        offer("c", 3.0, 2.0),  # 1.5 per unit
        offer("d", 1.0, 0.2),
    ]  # 5.0 per unit
    act = choose_active(nodes, required_per_s=2.0, margin=0.25)  # target 2.5
    assert act.target_per_s == pytest.approx(2.5)
    assert act.active == {"b", "c"} and act.standby == {"a", "d"}
    assert act.available_per_s == pytest.approx(3.0) and act.available_per_s >= act.target_per_s
    # a larger margin needs the next-cheapest node too
    act = choose_active(nodes, required_per_s=2.0, margin=0.6)  # target 3.2
    assert act.active == {"a", "b", "c"} and act.standby == {"d"}


def test_unbounded_or_unknown_requirement_activates_everyone() -> None:
    nodes = [offer("a", 1.0, 5.0), offer("b", 9.0, 5.0)]
    for req in (None, float("nan"), 0.0):
        act = choose_active(nodes, req, 0.25)
        assert act.active == {"a", "b"} and not act.standby and act.target_per_s is None


def test_nothing_measured_activates_everyone() -> None:
    nodes = [offer("a", 1.0, 0.0, False), offer("b", 2.0, 0.0, False)]
    act = choose_active(nodes, 1.0, 0.25)
    assert act.active == {"a", "b"} and not act.standby


def test_shortfall_activates_everyone() -> None:
    act = choose_active([offer("a", 1.0, 1.0), offer("b", 2.0, 1.0), offer("c", 0.0, 0.0, False)], 10.0, 0.25)
    assert act.active == {"a", "b", "c"} and not act.standby


def test_unmeasured_go_last() -> None:
    act = choose_active([offer("new", 0.0, 0.0, False), offer("a", 5.0, 2.0)], 1.0, 0.25)
    assert act.active == {"a"} and act.standby == {"new"}


def test_ties_are_deterministic_by_peer_id() -> None:
    nodes = [offer("z", 2.0, 1.0), offer("m", 2.0, 1.0), offer("a", 2.0, 1.0)]
    for perm in (nodes, nodes[::-1], [nodes[1], nodes[2], nodes[0]]):
        act = choose_active(perm, 0.5, 0.0)
        assert act.active == {"a"} and act.standby == {"m", "z"}


def test_equal_unit_prices_go_to_the_faster_node() -> None:
    act = choose_active([offer("a", 0.0, 1.0), offer("z", 0.0, 9.0)], 5.0, 0.0)
    assert act.active == {"z"} and act.standby == {"a"}


def test_at_least_one_active() -> None:
    act = choose_active([offer("a", 1.0, 100.0), offer("b", 1.0, 100.0)], 1e-6, 0.0)
    assert act.active == {"a"}
    assert choose_active([], 1.0, 0.25).active == set()


def test_margin_grows_with_losses() -> None:
    assert preemption_margin(0, 10, 0.25) == pytest.approx(0.25)
    assert preemption_margin(1, 10, 0.25) == pytest.approx(0.35)
    assert preemption_margin(5, 10, 0.25) == pytest.approx(0.75)
    assert preemption_margin(50, 10, 0.25) == pytest.approx(1.25)  # capped loss fraction
    assert preemption_margin(3, 0, 0.25) == pytest.approx(0.25)
    nodes = [offer(p, 1.0, 1.0) for p in "abcd"]
    few = choose_active(nodes, 2.0, preemption_margin(0, 4, 0.0))
    more = choose_active(nodes, 2.0, preemption_margin(2, 4, 0.0))
    assert len(more.active) > len(few.active)


# --- the learner's lease handler ---------------------------------------------------------------


def _service(mode: str) -> LearnerService:
    from echorl.tasks import load_task

    task = load_task("addition", digits=2, seed=0)
    svc = LearnerService(
        Identity.generate(),
        "run-1",
        task,
        tokenizer=None,
        buffer=StalenessBuffer(4, scorer=task.reward),
        settings=ServiceFields(activation=mode, activation_margin=0.0),
        vocab_size=100,
    )
    now = time.monotonic()
    for pid, price in (("cheap", 1.0), ("dear", 10.0)):
        cap = Capability(
            engine="torch",
            device="cpu",
            memory_bytes=0,
            tokens_per_s=1.0,
            price_per_hour=price,
            reachable=True,
            listen_addrs=[],
        )
        svc.peers.add(PeerRecord(pid, cap, now, now, version=0))
        svc.peers.load(pid).answered(groups=10, seconds=10.0)  # 1 group/s each, on the learner's clock
    svc.activator.required = lambda: 0.5
    return svc


async def _ask(svc: LearnerService, pid: str) -> object:
    req = LeaseRequest(run_id="run-1", version=0, max_prompts=4)
    svc.admission.told_to_wait(pid, 0.0, 0.0)  # the test steps time by hand: any retry_after has passed
    reply = await svc.on_lease(req, RequestContext(pid, "lease", time.monotonic()))
    wire.encode(reply)  # a valid wire message
    return reply


def test_on_lease_defers_standby_node() -> None:
    async def main() -> None:
        svc = _service("cost")
        act = svc.activator.reactivate()
        assert act is not None and act.active == {"cheap"} and act.standby == {"dear"}
        assert isinstance(await _ask(svc, "cheap"), Lease)
        reply = await _ask(svc, "dear")
        assert isinstance(reply, LeaseDeferred) and reply.reason == "standby" and reply.want_version == -1
        assert reply.retry_after_s > 0
        st = svc.status()
        assert st.learner["activation"] == "cost" and st.learner["nodes_standby"] == 1
        assert st.learner["activation_target_per_s"] == pytest.approx(0.5)
        assert {p["peer_id"]: p["standby"] for p in st.peers} == {"cheap": False, "dear": True}
        # the active node dies: the decision is re-made at once and the standby node takes over
        svc.peers["cheap"].alive = False
        svc.activator.lost("cheap")
        assert svc.activator.decision is not None and svc.activator.decision.active == {"dear"}
        assert isinstance(await _ask(svc, "dear"), Lease)
        assert svc.activator.metrics()["nodes_standby"] == 0

    trio.run(main)


def test_default_activation_leases_everyone() -> None:
    async def main() -> None:
        svc = _service("all")
        assert svc.activator.reactivate() is None
        assert isinstance(await _ask(svc, "cheap"), Lease)
        assert isinstance(await _ask(svc, "dear"), Lease)
        st = svc.status()
        assert st.learner["activation"] == "all" and st.learner["nodes_standby"] == 0
        assert not any(p["standby"] for p in st.peers)

    trio.run(main)


def test_hysteresis_keeps_an_active_node_until_the_cheaper_set_clearly_suffices() -> None:
    svc = _service("cost")
    svc.activator.required = lambda: 1.5  # needs both nodes (1 group/s each)
    assert svc.activator.reactivate().active == {"cheap", "dear"}
    svc.activator.required = lambda: 0.9  # cheap alone meets 0.9 × 1.0 but not 0.9 × 1.25: keep both
    assert svc.activator.reactivate().active == {"cheap", "dear"}
    svc.activator.required = lambda: 0.7  # 0.7 × 1.25 ≤ 1.0: park the dear node
    assert svc.activator.reactivate().standby == {"dear"}
    svc.activator.required = lambda: 0.9  # growing back needs no hysteresis, shrinking stays put
    assert svc.activator.reactivate().standby == {"dear"}
    svc.activator.required = lambda: 1.1
    assert svc.activator.reactivate().active == {"cheap", "dear"}


def test_a_node_that_claims_zero_seconds_is_ranked_by_what_the_learner_measured() -> None:
    """Issue 24, finding 2: the liar asks nothing and says every lease took it 0 s (before: 8,000
    groups/s, the only active node); the learner measured it at 0.1 group/s and the honest,
    dearer node at 1 group/s: the honest node stays active."""
    svc = _service("cost")
    liar, honest = svc.peers["cheap"], svc.peers["dear"]
    liar.capability = liar.capability.model_copy(update={"price_per_hour": 0.0})
    svc.peers.record_generation("cheap", groups=1000, seconds=1e-3, version=0)  # what it reports
    svc.peers.loads["cheap"] = type(svc.peers.load("dear"))()
    svc.peers.load("cheap").answered(groups=1, seconds=10.0)  # what the learner saw: 0.1 group/s
    assert liar.rollouts_per_s > 1e5 and svc.peers.measured_rate("cheap") == pytest.approx(0.1)
    act = svc.activator.reactivate()  # free but slow: it goes first and the honest node is still needed
    assert act is not None and honest.peer_id in act.active and not act.standby
    assert act.available_per_s == pytest.approx(1.1)
