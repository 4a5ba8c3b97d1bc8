"""Hostile peers over real libp2p hosts: the doubles the adversary tests and
``bench/adversary.py`` share. Each helper does one hostile (or setup) thing and returns what the
learner answered; nothing here asserts."""

from __future__ import annotations

import secrets
import struct
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import trio
from libp2p.peer.id import ID

from echorl.broadcast.relay import Relay
from echorl.net.framing import read_frame
from echorl.protocol import limits, routes, wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import (
    BroadcastAck,
    BroadcastDone,
    Capability,
    JoinAccepted,
    JoinRequest,
    Lease,
    LeaseDeferred,
    LeaseRequest,
    PlanAnnounce,
    RolloutGroup,
    Sample,
    StreamTicket,
    Submit,
    Subscribe,
)
from echorl.protocol.routes import ANNOUNCE, DONE

RUN = "echorl-demo"
THIRD_PARTY = "127.0.0.2"  # an address that is no peer's: where an SSRF attempt aims
SMUGGLED = b"DELETE /_all\r\n\r\n"  # ticket bytes an attacker would have a victim send (16: the one length)
NEG_ONE_F64 = b"\xcb\xbf\xf0\x00\x00\x00\x00\x00\x00"  # msgpack float64 -1.0
NEAR_NEG_1E300 = bytes.fromhex("fe3c9e7d1f2a4c3b")  # a finite float64 ≈ -1e300 (float32: -inf)


def capability(addrs: list[str], tokens_per_s: float = 1.0) -> Capability:
    return Capability(
        engine="torch",
        device="cpu",
        memory_bytes=1,
        tokens_per_s=tokens_per_s,
        price_per_hour=0.0,
        reachable=True,
        listen_addrs=addrs[:16],
    )


async def join(
    host: Any,
    learner: str,
    me: Identity,
    tokens_per_s: float = 1.0,
    run_id: str = RUN,
    addrs: list[str] | None = None,
) -> JoinAccepted:
    """Join as a (so far) well-behaved node, advertising ``addrs`` (default: the host's own)."""
    msg = JoinRequest(
        run_id=run_id,
        peer_id=me.peer_id,
        capability=capability(list(host.addrs) if addrs is None else addrs, tokens_per_s),
        version=-1,
        timestamp=time.time(),
        nonce=secrets.token_bytes(16),
    )
    reply = await host.request(learner, routes.JOIN, wire.sign(msg, me), expect=JoinAccepted)
    assert isinstance(reply, JoinAccepted)
    return reply


async def newest_lease(host: Any, learner: str, tries: int = 400, run_id: str = RUN) -> tuple[Lease, int]:
    """A lease for the newest published version (the learner names it when asked for a newer one)."""
    reasons = Counter[str]()

    async def ask(version: int) -> Lease | LeaseDeferred:
        req = LeaseRequest(run_id=run_id, version=version, max_prompts=2)
        return await host.request(learner, routes.LEASE, req, expect=(Lease, LeaseDeferred))

    for _ in range(tries):
        # A version above any published is answered at once with the newest (no wait is set), so
        # each try claims the newest version however fast the learner steps.
        version, reply = 2**40, await ask(2**40)
        if isinstance(reply, LeaseDeferred) and reply.reason == "weights_unknown":
            version = reply.want_version
            reply = await ask(version)
        if isinstance(reply, Lease):
            return reply, version
        reasons[f"{reply.reason} (retry {reply.retry_after_s:.2f} s)"] += 1
        await trio.sleep(max(0.05, reply.retry_after_s))  # asking earlier is refused (rate_limited)
    raise TimeoutError(f"no lease in {tries} tries: deferred {dict(reasons.most_common(6))}")


def nonfinite_logprob_body(submit: Submit) -> bytes:
    """``submit`` (with a −1.0 log-prob) encoded with that log-prob turned into ≈ −1e300: finite
    as float64, −inf as float32; the model refuses to build it, so it is patched on the wire."""
    body = bytearray(wire.encode(submit))
    at = body.find(NEG_ONE_F64)
    if at < 0:
        raise ValueError("the submission carries no -1.0 log-prob to patch")
    body[at + 1 : at + 9] = NEAR_NEG_1E300
    return bytes(body)


def empty_completion_body(lease: Lease, version: int, me: Identity) -> bytes:
    """A signed submission whose samples have no tokens (the model refuses to build one)."""
    sample = Sample.model_construct(token_ids=[], logprobs=[], finish_reason="length", reward_hint=0.0, model_mask=None)
    groups = [
        RolloutGroup.model_construct(prompt_id=p.prompt_id, samples=[sample] * lease.group_size) for p in lease.prompts
    ]
    msg = Submit.model_construct(
        type="submit",
        run_id=lease.run_id,
        lease_id=lease.lease_id,
        peer_id=me.peer_id,
        behaviour_version=version,
        groups=groups,
        generate_seconds=0.1,
        nonce=secrets.token_bytes(16),
        signature=b"\0" * 64,
        incarnation=None,
    )
    return wire.encode(wire.sign(msg, me))


async def raw_request(host: Any, peer: str, protocol: str, frame: bytes, timeout: float = 20.0) -> str:
    """Write ``frame`` (a length header and whatever follows) on a new stream; the error code
    answered, or the reply's type."""
    stream = await host.libp2p.new_stream(ID.from_base58(peer), [protocol])
    try:
        await stream.write(frame)
        body = await read_frame(stream, max_bytes=1 << 20, first_byte_timeout=timeout, io_timeout=timeout)
        msg = wire.decode(body)
        return getattr(msg, "code", msg.type)
    finally:
        await stream.close()


def framed(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def oversized_header(announced: int = 16 * 1024 * 1024, sent: int = 64) -> bytes:
    """A frame header announcing ``announced`` bytes followed by only ``sent`` of them."""
    return struct.pack(">I", announced) + b"\0" * sent


def plan_member(
    host: Any, nursery: trio.Nursery, learner: str, report: bool | Callable[[int], bool], run_id: str = RUN
) -> None:
    """Make ``host`` a plan member that acknowledges every announce; it reports the version done
    only if ``report`` (or ``report(version)``); otherwise it is the silent member, which answers
    pings and never reports."""

    async def on_announce(msg: Any, ctx: Any) -> BroadcastAck:
        assert isinstance(msg, PlanAnnounce)
        if report(msg.version) if callable(report) else report:
            done = BroadcastDone(
                run_id=run_id, version=msg.version, ok=True, seconds=0.1, recovered_chunks=0, suspects=[], detail=""
            )
            nursery.start_soon(host.request, learner, DONE, done)
        return BroadcastAck(run_id=run_id, version=msg.version, have_version=msg.version)

    host.route(ANNOUNCE, on_announce, request=PlanAnnounce)


def fake_done(version: int, suspects: list[str], run_id: str = RUN) -> BroadcastDone:
    """A ``BroadcastDone`` naming ``suspects`` as bad parents (from a peer not in that plan)."""
    return BroadcastDone(
        run_id=run_id,
        version=version,
        ok=True,
        seconds=0.1,
        recovered_chunks=0,
        suspects=suspects[:64],
        detail="parent sent bad chunks",
    )


class ThirdParty:
    """A TCP listener on ``THIRD_PARTY`` that counts what reaches it (an SSRF target)."""

    def __init__(self) -> None:
        self.connections = 0
        self.bytes = 0
        self.port = 0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host=THIRD_PARTY)
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._on, listeners)

    async def _on(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        with trio.move_on_after(10):
            while data := await stream.receive_some(65536):
                self.bytes += len(data)


def aimed_addrs(host: Any, target: ThirdParty) -> list[str]:
    """The host's addresses with the third party's first, as if it were ours."""
    return [f"/ip4/{THIRD_PARTY}/tcp/{target.port}/p2p/{host.peer_id}", *host.addrs]


def ticket_to(host: Any, target: ThirdParty) -> None:
    """Answer every direct-path ticket request (pulled: ``TICKET``, pushed: ``PUSH``) with the
    third party's port and ticket bytes of our choice."""

    async def on_ticket(msg: Any, ctx: Any) -> StreamTicket:
        assert isinstance(msg, Subscribe)
        return StreamTicket(ticket=SMUGGLED[: limits.TICKET_BYTES], port=target.port)

    host.route(routes.TICKET, on_ticket, request=Subscribe)
    host.route(routes.PUSH, on_ticket, request=Subscribe)


class SilentRelay(Relay):
    """A relay that takes every announcement, relays chunks and reports as an honest node does,
    but passes no announcement on to its stripe-0 children (``broadcast/announcing.py``)."""

    async def _forward(self, version: int, children: list[str], encoded: bytes) -> None:
        return None
