"""The HTTP face of ``echorl serve``: Tinker's REST routes (``/api/v1/…``) as a Starlette app.

Every route checks the ``X-API-Key`` header first (the Tinker client's auth header,
``tinker/lib/_auth_token_provider.py``): no valid key is a 401 and nothing else runs. Bodies are
read with a cap (413 beyond ``--max-body-mb``). Errors are one JSON line the client prints
(``{"detail": …}``) with a status it does not retry: 400 bad request, 404 unknown (or someone
else's) id, 413, 429 (queue full: retried with back-off), 410 a finished session. An endpoint
echorl does not implement answers 404 naming it, so the client fails at once instead of hanging.

Which status codes the client retries (408, 409, 429, 5xx) and how it polls futures was read
in tinker 0.38.0 ``lib/internal_client_holder.py`` (``_is_retryable_status_code``) and
``lib/api_future_impl.py``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from . import losses, wire
from .api import Api
from .engine import EngineError
from .futures import UserError
from .sessions import NotFound, check_key

log = logging.getLogger(__name__)
ALL_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]
TELEMETRY_MAX_BYTES = 1 << 20
"""Telemetry the tinker client sends by default is read (bounded) and dropped."""


class HttpError(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


def _error(status: int, detail: str) -> JSONResponse:
    return JSONResponse({"detail": detail[:2000]}, status_code=status)


async def _body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise HttpError(413, f"request body larger than the server's {limit} bytes (--max-body-mb)")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, f"request body larger than the server's {limit} bytes (--max-body-mb)")
        chunks.append(chunk)
    return b"".join(chunks)


def _json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise HttpError(400, "request body is not JSON") from None
    if not isinstance(body, dict):
        raise HttpError(400, "request body must be a JSON object")
    return body


class App:
    """Routes to :class:`Api` methods; owns auth, body limits, content negotiation and errors."""

    def __init__(self, api: Api, keys: dict[str, str]) -> None:
        self.api = api
        self.keys = keys
        self.limit = int(api.cfg.max_body_mb * (1 << 20))
        post = {
            "/api/v1/client/config": self.client_config,
            "/api/v1/client/dynamic_config": lambda u, b: {"refresh_interval_sec": 300, "sample_cancel_enabled": False},
            "/api/v1/create_session": lambda u, b: api.create_session(u),
            "/api/v1/session_heartbeat": self.heartbeat,
            "/api/v1/create_model": api.create_model,
            "/api/v1/get_info": api.get_info,
            "/api/v1/unload_model": api.unload_model,
            "/api/v1/optim_step": api.optim_step,
            "/api/v1/save_weights": api.save_weights,
            "/api/v1/save_weights_for_sampler": api.save_weights_for_sampler,
            "/api/v1/load_weights": api.load_weights,
            "/api/v1/create_sampling_session": api.create_sampling_session,
            "/api/v1/asample": api.sample,
            "/api/v1/telemetry": lambda u, b: {"status": "accepted"},
        }
        routes = [Route(path, self._json_route(fn), methods=["POST"]) for path, fn in post.items()]
        routes += [
            Route("/api/v1/healthz", self._plain(lambda u: {"status": "ok"}), methods=["GET"]),
            Route("/api/v1/get_server_capabilities", self._plain(lambda u: api.capabilities()), methods=["GET"]),
            Route("/api/v1/echorl/usage", self._plain(self.usage), methods=["GET"]),
            Route("/api/v1/samplers/{sampler_id:path}", self.sampler, methods=["GET"]),
            Route("/api/v1/sessions/{session_id}/finish", self.finish, methods=["POST"]),
            Route("/api/v1/forward_backward", self.forward_backward, methods=["POST"]),
            Route("/api/v1/forward", self.forward, methods=["POST"]),
            Route("/api/v1/retrieve_future", self.retrieve_future, methods=["POST"]),
            Route("/{path:path}", self.unsupported, methods=ALL_METHODS),
        ]
        self.app = Starlette(routes=routes)

    # ------------------------------------------------------------ plumbing

    def _user(self, request: Request) -> str:
        user = check_key(self.keys, request.headers.get("x-api-key"))
        if user is None:
            raise HttpError(401, "invalid or missing API key (X-API-Key)")
        return user

    async def _guard(self, request: Request, handler: Any) -> Response:
        try:
            user = self._user(request)
            return await handler(user)
        except HttpError as exc:
            return _error(exc.status, exc.detail)
        except NotFound as exc:
            return _error(404, str(exc))
        except OverflowError as exc:
            return _error(429, str(exc))
        except (UserError, wire.WireError, EngineError, losses.LossInputError, ValueError, TypeError, KeyError) as exc:
            return _error(400, str(exc) or type(exc).__name__)

    def _json_route(self, fn: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            async def handle(user: str) -> Response:
                limit = TELEMETRY_MAX_BYTES if request.url.path.endswith("/telemetry") else self.limit
                body = _json(await _body(request, limit))
                out = fn(user, body)
                return out if isinstance(out, Response) else JSONResponse(out)

            return await self._guard(request, handle)

        return endpoint

    def _plain(self, fn: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            async def handle(user: str) -> Response:
                return JSONResponse(fn(user))

            return await self._guard(request, handle)

        return endpoint

    # ------------------------------------------------------------ routes with their own shape

    def client_config(self, user: str, body: dict[str, Any]) -> dict[str, Any]:
        """Feature flags (tinker ``types/client_config_response.py``): plain API-key auth, httpx
        transport, no server-side custom losses, no retrieve_futures poller, JSON fwd/bwd for 0.21."""
        return {
            "pjwt_auth_enabled": False,
            "use_pyqwest_transport": False,
            "proto_write_fwdbwd": False,
            "proto_compress_fwdbwd": False,
            "parallel_fwdbwd_chunks": True,
            "sample_use_retrieve_futures": False,
            "sample_join_sampling_session": False,
            "custom_loss_server_side": False,
            "fwdbwd_max_chunk_len": self.api.cfg.max_data_per_request,
            "fwdbwd_max_chunk_bytes_count": max(1, self.limit // 2),
        }

    def heartbeat(self, user: str, body: dict[str, Any]) -> Any:
        session = self.api.heartbeat(user, str(body.get("session_id", "")))
        if session.finished:
            return _error(410, f"session {session.ident} has finished")
        return {"type": "session_heartbeat"}

    def usage(self, user: str) -> dict[str, Any]:
        return {"sessions": [row for row in self.api.sessions.summary() if row["user"] == user]}

    async def sampler(self, request: Request) -> Response:
        async def handle(user: str) -> Response:
            return JSONResponse(self.api.get_sampler(user, request.path_params["sampler_id"]))

        return await self._guard(request, handle)

    async def finish(self, request: Request) -> Response:
        async def handle(user: str) -> Response:
            await _body(request, TELEMETRY_MAX_BYTES)
            self.api.finish(user, request.path_params["session_id"])
            return JSONResponse({})

        return await self._guard(request, handle)

    async def _fwdbwd(self, request: Request, forward_only: bool) -> Response:
        async def handle(user: str) -> Response:
            raw = await _body(request, self.limit)
            if wire.PROTO in request.headers.get("content-type", ""):
                if request.headers.get("content-encoding", "identity") != "identity":
                    raise HttpError(400, "compressed protobuf bodies are not accepted (the server never asks for them)")
                req = wire.fwdbwd_from_proto(raw, self.api.limits)
            else:
                req = wire.fwdbwd_from_json(_json(raw), self.api.limits, forward_only)
            return JSONResponse(self.api.forward_backward(user, req))

        return await self._guard(request, handle)

    async def forward_backward(self, request: Request) -> Response:
        return await self._fwdbwd(request, forward_only=False)

    async def forward(self, request: Request) -> Response:
        return await self._fwdbwd(request, forward_only=True)

    async def retrieve_future(self, request: Request) -> Response:
        async def handle(user: str) -> Response:
            body = _json(await _body(request, TELEMETRY_MAX_BYTES))
            ident = str(body.get("request_id", ""))
            fut = self.api.futures.get(user, ident)
            if fut is None:
                raise NotFound(f"unknown or expired request id {ident[:80]!r}")
            if not await self.api.futures.wait(fut):
                return JSONResponse({"type": "try_again", "request_id": ident, "queue_state": "active"})
            if fut.error is not None:
                return JSONResponse({"error": fut.error, "category": fut.category})
            if fut.kind == "json":
                return JSONResponse(fut.result)
            proto = wire.wants_proto(request.headers.get("accept", ""))
            if fut.kind == "fwdbwd":
                raw = wire.fwdbwd_proto(fut.result) if proto else None
                return Response(raw, media_type=wire.PROTO) if proto else JSONResponse(wire.fwdbwd_json(fut.result))
            raw = wire.sample_proto(fut.result) if proto else None
            return Response(raw, media_type=wire.PROTO) if proto else JSONResponse(wire.sample_json(fut.result))

        return await self._guard(request, handle)

    async def unsupported(self, request: Request) -> Response:
        async def handle(user: str) -> Response:
            return _error(404, f"echorl serve does not implement {request.method} {request.url.path}")

        return await self._guard(request, handle)
