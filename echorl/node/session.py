"""The node's conversation with the learner: find and join it, then lease → work → submit until
something ends the session; reconnect with back-off (``work_forever``), say why, and end the
node (``NodeExit``) on a refusal that cannot heal. ``RunOver`` is the learner's signed end of the
run."""

from __future__ import annotations

import logging
import random
import shlex
import time
from typing import Any

import trio

from echorl.node.config import NodeConfig
from echorl.node.progress import NodeState
from echorl.node.rollouts import EnvironmentRefused, generate_and_submit

log = logging.getLogger(__name__)


class NodeExit(Exception):
    """Ends the node with ``code`` and a one-line ``message`` (no traceback)."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


class RunOver(Exception):
    """The learner said the run is over (``state.ended`` holds its signed ``RunEnded``)."""


async def return_lease(host: Any, state: NodeState) -> None:
    from echorl.net.host import PeerUnavailable, RemoteError
    from echorl.protocol import routes
    from echorl.protocol.messages import LeaseReturn

    if not state.current_lease or not state.learner:
        return
    try:
        await host.request(
            state.learner, routes.RETURN, LeaseReturn(run_id=state.run_id, lease_ids=[state.current_lease]), timeout=5
        )
        log.info("returned lease %s", state.current_lease)
    except (PeerUnavailable, RemoteError) as exc:
        log.warning("could not return lease %s: %s", state.current_lease, exc)


async def work_forever(host: Any, cfg: NodeConfig, state: NodeState, cap: Any, nursery: trio.Nursery) -> None:
    from echorl.actor.lora import BaseMismatch
    from echorl.net.host import PeerUnavailable
    from echorl.protocol.errors import ErrorCode, ProtocolError

    backoff = 0.5
    refused = ""  # the learner's last refusal since it last served us ("" while it does not answer)
    while True:
        started = time.monotonic()
        try:
            await _session(host, cfg, state, cap, nursery)
        except RunOver:
            return
        except BaseMismatch as exc:  # the run's adapters are for another base model
            raise NodeExit(2, str(exc)) from None
        except ProtocolError as exc:  # an Error reply (RemoteError) or a RunEnded that fails verification
            if exc.code == ErrorCode.IDENTITY_IN_USE:
                raise NodeExit(2, f"the learner refused this node: {exc.detail} (key {cfg.key})") from None
            refused = str(exc)
            log.warning("learner refused (%s); retrying in %.1f s", exc, backoff)
        except (PeerUnavailable, trio.TooSlowError) as exc:
            refused = ""
            log.warning("learner unreachable: %s; retrying in %.1f s", exc, backoff)
        if state.leases_done and time.monotonic() - started > 10.0:
            backoff = 0.5  # the session worked for a while: a fresh failure, not a streak
        state.current_lease = ""
        silent = time.monotonic() - state.last_contact
        if cfg.give_up_after > 0 and silent + backoff > cfg.give_up_after:
            why = f"the learner refused us ({refused})" if refused else "no answer from the learner"
            raise NodeExit(
                1,
                f"gave up: {why} for {silent:.0f} s (--give-up-after {cfg.give_up_after:g}); is the run "
                f"still going at {cfg.bootstrap}?",
            )
        await trio.sleep(backoff * (0.75 + 0.5 * random.random()))
        backoff = min(backoff * 2, 15.0)


async def _session(host: Any, cfg: NodeConfig, state: NodeState, cap: Any, nursery: trio.Nursery) -> None:
    """Connect, join, get weights, then loop lease → generate → submit until an error ends the
    session."""
    import secrets

    from echorl.net.host import RemoteError
    from echorl.net.membership import find_learner
    from echorl.protocol import routes, wire
    from echorl.protocol.errors import ErrorCode
    from echorl.protocol.messages import JoinAccepted, JoinRequest

    weights = state.weights
    state.learner = await find_learner(
        host, cfg.bootstrap, state.run_id, state.membership, pinned=cfg.learner_id or None
    )
    await weights.attach(state.learner, nursery)
    join = wire.sign(
        JoinRequest(
            run_id=state.run_id,
            peer_id=host.peer_id,
            capability=cap,
            version=weights.version,
            timestamp=time.time(),
            nonce=secrets.token_bytes(16),
            instance=state.instance,
        ),
        host.identity,
    )
    try:
        accepted = await host.request(state.learner, routes.JOIN, join, expect=JoinAccepted)
    except RemoteError as exc:
        if exc.code == ErrorCode.NOT_FOUND:  # "run … is not served here": no retry can heal that
            await _check_served_run(host, cfg, state.learner)
        raise
    assert isinstance(accepted, JoinAccepted)
    state.last_contact = time.monotonic()
    _log_observed(host)
    log.info(
        "joined run %s at learner version %d (S=%d) holding v%d",
        state.run_id,
        accepted.version,
        accepted.staleness_bound,
        weights.version,
    )
    weights.joined(state.learner, accepted.incarnation)  # a restarted learner: drop its abandoned branch
    if weights.version > accepted.version:  # the learner resumed from an older checkpoint
        weights.forget(state.learner)
    if state.membership is not None:
        await state.membership.provide()
    await weights.ensure(0)
    idle = 0.05
    while True:
        lease, wait = await _request_lease(host, cfg, state)
        if lease is None:
            if wait > 0:
                await trio.sleep(max(wait, idle))
                idle = min(idle * 1.5, 0.5)
            continue
        idle = 0.05
        state.current_lease = lease.lease_id
        try:
            await generate_and_submit(host, state, lease)
        except EnvironmentRefused as exc:  # cannot run this run's episodes: give the work back
            log.error("%s; returning the lease", exc)
            await return_lease(host, state)
            state.current_lease = ""
            await trio.sleep(10.0)
            continue
        state.current_lease = ""
        state.leases_done += 1


async def _check_served_run(host: Any, cfg: NodeConfig, learner: str) -> None:
    """After a join refused as ``not_found``: ask the learner which run it serves (its public
    ``Status``) and end the node (exit 2) if it is another than ours, naming it."""
    from echorl.net.host import PeerUnavailable, RemoteError
    from echorl.protocol import routes
    from echorl.protocol.messages import Status, StatusRequest

    try:
        status = await host.request(learner, routes.STATUS, StatusRequest(), expect=Status, timeout=10.0)
    except (PeerUnavailable, RemoteError, trio.TooSlowError):
        return  # it did not say: the refusal is retried like any other
    assert isinstance(status, Status)
    if status.run_id != cfg.run_id:
        raise NodeExit(
            2,
            f"the learner at {cfg.bootstrap} serves run {status.run_id!r}, not {cfg.run_id!r}: "
            f"start the node with --run-id {shlex.quote(status.run_id)}",
        )


async def _request_lease(host: Any, cfg: NodeConfig, state: NodeState) -> tuple[Any, float]:
    """(lease, 0) or (None, seconds to wait): a deferral for old or unknown weights updates them
    first and asks again at once (or shortly, if nothing newer is to be had yet), or once the
    deferral's ``retry_after_s`` has passed (an unproven node is given one)."""
    from echorl.protocol import routes, wire
    from echorl.protocol.messages import Lease, LeaseDeferred, LeaseRequest, RunEnded

    weights = state.weights
    reply = await host.request(
        state.learner,
        routes.LEASE,
        LeaseRequest(
            run_id=state.run_id, version=weights.version, max_prompts=cfg.max_prompts, incarnation=weights.incarnation
        ),
        expect=(Lease, LeaseDeferred, RunEnded),
    )
    state.last_contact = time.monotonic()
    if isinstance(reply, RunEnded):
        await trio.to_thread.run_sync(wire.verify, reply, state.learner)  # only the pinned learner ends our run
        state.ended = reply
        raise RunOver()
    if isinstance(reply, Lease):
        return reply, 0.0
    assert isinstance(reply, LeaseDeferred)
    if reply.reason == "weights_unknown":  # ahead of the learner: it went back to a checkpoint
        weights.forget(state.learner)
        await weights.ensure(0)
        return None, 0.0
    if reply.reason == "weights_too_old":
        before, told_at = weights.version, time.monotonic()
        await weights.ensure(max(reply.want_version, weights.version + 1))
        left = reply.retry_after_s - (time.monotonic() - told_at)  # asking earlier is refused
        return None, max(left, 0.05 if weights.version == before else 0.0)  # 0.05: nothing newer yet
    return None, max(reply.retry_after_s, 0.01)


def _log_observed(host: Any) -> None:
    """Log how the learner sees us (identify's observed address), once it differs from before."""
    seen = host.observed_addrs()
    if seen and seen != getattr(host, "_logged_observed", None):
        host._logged_observed = seen
        mine = {a.split("/p2p/")[0].rsplit("/tcp/", 1)[0] for a in host.addrs}
        behind = all(a.rsplit("/tcp/", 1)[0] not in mine for a in seen)
        log.info(
            "the learner sees this node as %s%s",
            ", ".join(seen),
            " (not one of our addresses: behind NAT, so a broadcast leaf)" if behind else "",
        )
