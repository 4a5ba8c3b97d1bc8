"""The serving side of a ``Host``: routes, each with a request cap, a rate limit, a deadline
and an optional sender check (``admit``) asked before any body is read.

``RouteServer.route(protocol, handler, ...)`` serves ``/echorl/<name>/1``: framed msgpack
requests, one reply each, several requests per stream. A peer ``admit`` refuses gets
``Error(not_found)`` and the stream is closed unread; a peer refused ``RefusalStrikes.limit``
times within its window is struck off (``net/guard.py``): its streams are reset unanswered, its
connection closed and its address banned as long, unless a peer admitted somewhere shares it.
Bodies over ``OFFLOAD_DECODE_BYTES`` are decoded in a worker thread, never on the event loop. A
handler that raises never takes the host down: the error is logged, the peer gets
``Error(internal)`` and the stream is closed. ``ProtocolError`` from a handler becomes
``Error(code)``. Per-peer token-bucket rate limits, per-route request size caps, a per-peer cap
on concurrent streams, and deadlines on every read, write and handler.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio
from libp2p.custom_types import TProtocol

from echorl.net.framing import (
    STREAM_ERRORS,
    CleanEnd,
    IdleTimeout,
    Truncated,
    close_quietly,
    error_message,
    read_frame,
    reset_quietly,
    write_message,
)
from echorl.net.guard import RefusalStrikes
from echorl.net.hostkey import same_host
from echorl.net.ratelimit import RateLimit, TokenBuckets
from echorl.net.routes import RATES
from echorl.protocol import limits, wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import short_id
from echorl.protocol.messages import Error, Message
from echorl.protocol.routes import ROUTES

if TYPE_CHECKING:
    from echorl.net.host import Host

log = logging.getLogger(__name__)

Handler = Callable[[Message, "RequestContext"], Awaitable[Message]]
#: the sender check of a route: True if the peer may send; an async one may wait (boundedly) for
#: what would admit the peer (a plan announcement on its way), and is not asked about neighbours
Admit = Callable[[str], bool] | Callable[[str], Awaitable[bool]]

OFFLOAD_DECODE_BYTES = 64 * 1024  # larger request bodies are decoded (and validated) off the event loop


@dataclass(frozen=True)
class RequestContext:
    peer_id: str  # the authenticated remote peer (the stream's muxed_conn.peer_id)
    protocol: str
    received_at: float
    body_bytes: int | None = None  # the request's encoded size (None: unknown, e.g. a test's direct call)


@dataclass
class Route:
    protocol: str
    handler: Handler
    request_types: tuple[type[Message], ...]
    max_request_bytes: int
    rate: RateLimit | None
    timeout_s: float
    buckets: TokenBuckets | None = None
    admit: Admit | None = None  # asked before a body is read; None: everyone


@dataclass
class HostStats:
    served: int = 0
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    handler_failures: int = 0
    truncated: int = 0


class RouteServer:
    """The routes one ``Host`` serves (see module doc); ``Host.route`` and ``Host.serve`` add them."""

    def __init__(self, host: Host) -> None:
        self.host = host
        self.stats = HostStats()
        self.strikes = RefusalStrikes()  # strangers that keep hammering routes they may not use
        self._routes: dict[str, Route] = {}
        self._admits: list[Callable[[str], bool]] = []  # the sync sender checks (a struck peer's neighbours)
        self._inbound: dict[str, int] = defaultdict(int)

    def route(
        self,
        protocol: str,
        handler: Handler,
        *,
        request: type[Message] | tuple[type[Message], ...],
        max_request_bytes: int = 64 * 1024,
        rate: RateLimit | None = RateLimit(20.0, 40.0),
        timeout_s: float | None = None,
        admit: Admit | None = None,
    ) -> None:
        types = request if isinstance(request, tuple) else (request,)
        r = Route(
            protocol,
            handler,
            types,
            min(max_request_bytes, limits.MAX_FRAME_BYTES),
            rate,
            timeout_s or self.host.config.handler_timeout_s,
            TokenBuckets(rate) if rate else None,
            admit,
        )
        self._routes[protocol] = r
        self._note_admit(admit)

        async def _entry(stream: Any) -> None:
            await self._serve_stream(r, stream)

        self.host.libp2p.set_stream_handler(TProtocol(protocol), _entry)

    def serve(
        self,
        handlers: Mapping[str, Handler],
        *,
        admit: Mapping[str, Admit] | None = None,
        max_request_bytes: Mapping[str, int] | None = None,
    ) -> None:
        """Register each ``{stream id: handler}``: the request type and size cap come from the
        protocol's route table (``protocol/routes.py``), the rate limit from ``net/routes.py``;
        ``admit`` and ``max_request_bytes`` (per stream id) add a peer check before any body is
        read and a smaller cap (``route``)."""
        for proto, handler in handlers.items():
            spec = ROUTES[proto]
            cap = min(spec.max_request_bytes, (max_request_bytes or {}).get(proto, spec.max_request_bytes))
            self.route(
                proto,
                handler,
                request=spec.request,
                max_request_bytes=cap,
                rate=RATES[proto],
                admit=(admit or {}).get(proto),
            )

    async def _serve_stream(self, route: Route, stream: Any) -> None:
        """Entry point libp2p calls: nothing may escape it (an escaping error kills the host)."""
        peer = "?"
        try:
            peer = str(stream.muxed_conn.peer_id)
            if self.strikes.banned(peer, trio.current_time()):
                await reset_quietly(stream)
                return
            if self._inbound[peer] >= self.host.config.max_streams_per_peer:
                self._refused(ErrorCode.RATE_LIMITED)
                await self._reply(stream, Error(code=ErrorCode.RATE_LIMITED.value, detail="too many streams"))
                await reset_quietly(stream)
                return
            self._inbound[peer] += 1
            try:
                await self._serve_loop(route, stream, peer)
            finally:
                self._inbound[peer] -= 1
                if self._inbound[peer] <= 0:
                    self._inbound.pop(peer, None)
        except Exception as exc:
            self.stats.handler_failures += 1
            log.exception("stream %s from %s failed: %s", route.protocol, short_id(peer), exc)
            await reset_quietly(stream)

    async def _strike(self, peer: str) -> None:
        """``peer`` was struck off (``RefusalStrikes``): close its connection and ban its address
        (an IPv6 address: its /64) for as long, unless a peer admitted on some route shares what
        the ban would cover (a NAT, a shared host or an IPv6 /64: one hostile identity must not
        lock out the honest peers behind it)."""
        ip = self.host.remote_ip(peer)
        shared = ip is not None and any(
            other != peer and same_host(self.host.remote_ip(other), ip) and self._admitted_anywhere(other)
            for other in self.host.connected_peers()
        )
        if ip is not None and not shared:
            self.host.guard.ban(ip, self.strikes.ban_s)
        log.warning(
            "%s: %d streams refused unadmitted within %.0f s: struck off for %.0f s%s",
            short_id(peer),
            self.strikes.limit,
            self.strikes.window_s,
            self.strikes.ban_s,
            "" if ip is None or shared else f", its address {ip} banned as long",
        )
        await self.host.disconnect(peer)

    def _admitted_anywhere(self, peer: str) -> bool:
        return any(admit(peer) for admit in self._admits)

    def _note_admit(self, admit: Admit | None) -> None:
        if admit is not None and not inspect.iscoroutinefunction(admit) and admit not in self._admits:
            self._admits.append(admit)  # type: ignore[arg-type]

    async def admitted(self, stream: Any, peer: str, admit: Admit | None) -> bool:
        """The sender check before a body is read: True if ``peer`` may send on ``stream``
        (``admit`` None: anyone). Else the stream is answered ``not_found`` and closed unread;
        past the strike limit it is reset unanswered and the peer struck off (``_strike``).
        Raw chunk-stream routes (``net/transport/libp2p_streams.py``) pass their check here too."""
        if admit is None:
            return True
        self._note_admit(admit)
        if self.strikes.banned(peer, trio.current_time()):
            await reset_quietly(stream)
            return False
        ok = admit(peer)
        if not isinstance(ok, bool):
            ok = await ok
        if ok:
            return True
        self._refused(ErrorCode.NOT_FOUND)
        if self.strikes.refuse(peer, trio.current_time()):
            await reset_quietly(stream)
            await self._strike(peer)
            return False
        await self._reply(stream, Error(code=ErrorCode.NOT_FOUND.value, detail="not admitted: join first"))
        await close_quietly(stream)
        return False

    async def _serve_loop(self, route: Route, stream: Any, peer: str) -> None:
        cfg = self.host.config
        while True:
            if not await self.admitted(stream, peer, route.admit):
                return
            try:
                body = await read_frame(
                    stream,
                    max_bytes=route.max_request_bytes,
                    first_byte_timeout=cfg.idle_timeout_s,
                    io_timeout=cfg.io_timeout_s,
                )
            except CleanEnd:
                await close_quietly(stream)
                return
            except IdleTimeout:  # a pooled stream nobody used for idle_timeout_s: closed, not an error
                log.debug("%s from %s: idle stream closed", route.protocol, short_id(peer))
                await close_quietly(stream)
                return
            except (Truncated, trio.TooSlowError) as exc:
                self.stats.truncated += 1
                log.info("%s from %s: %s", route.protocol, short_id(peer), type(exc).__name__)
                await reset_quietly(stream)
                return
            except ProtocolError as exc:  # oversized or bad header: the stream cannot be resynced
                self._refused(exc.code)
                await self._reply(stream, error_message(exc))
                await close_quietly(stream)
                return
            if route.buckets is not None and not route.buckets.take(peer):
                self._refused(ErrorCode.RATE_LIMITED)
                if self.strikes.refuse(peer, trio.current_time()):  # past the rate again and again
                    await reset_quietly(stream)
                    await self._strike(peer)
                    return
                if not await self._reply(stream, Error(code=ErrorCode.RATE_LIMITED.value, detail=route.protocol)):
                    return
                continue
            try:
                msg = (
                    wire.decode(body)
                    if len(body) <= OFFLOAD_DECODE_BYTES
                    else await trio.to_thread.run_sync(wire.decode, body)
                )
                if not isinstance(msg, route.request_types):
                    raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"{msg.type!r} not served on {route.protocol}")
            except ProtocolError as exc:
                self._refused(exc.code)
                await self._reply(stream, error_message(exc))
                await close_quietly(stream)
                return
            ctx = RequestContext(peer_id=peer, protocol=route.protocol, received_at=time.time(), body_bytes=len(body))
            try:
                with trio.fail_after(route.timeout_s):
                    reply = await route.handler(msg, ctx)
            except ProtocolError as exc:
                self._refused(exc.code)
                reply = error_message(exc)
            except trio.TooSlowError:
                self.stats.handler_failures += 1
                log.warning(
                    "handler %s for %s missed its %.0f s deadline", route.protocol, short_id(peer), route.timeout_s
                )
                await self._reply(stream, Error(code=ErrorCode.INTERNAL.value, detail="handler deadline"))
                await close_quietly(stream)
                return
            except Exception as exc:
                self.stats.handler_failures += 1
                log.exception("handler %s failed for %s: %s", route.protocol, short_id(peer), exc)
                await self._reply(stream, Error(code=ErrorCode.INTERNAL.value, detail=type(exc).__name__))
                await close_quietly(stream)
                return
            else:
                self.stats.served += 1
            if not await self._reply(stream, reply):
                return
            if self.strikes.banned(peer, trio.current_time()):  # struck off by this request: answered, closed
                await close_quietly(stream)
                return

    async def _reply(self, stream: Any, msg: Message) -> bool:
        try:
            await write_message(stream, msg, timeout=self.host.config.io_timeout_s)
            return True
        except ProtocolError as exc:  # our own reply is too large: a bug, answer with an error
            log.error("reply not encodable: %s", exc)
            return await self._reply(stream, error_message(ProtocolError(ErrorCode.INTERNAL, "reply too large")))
        except (trio.TooSlowError, *STREAM_ERRORS):
            await reset_quietly(stream)
            return False

    def _refused(self, code: ErrorCode) -> None:
        self.stats.refused[code.value] += 1
