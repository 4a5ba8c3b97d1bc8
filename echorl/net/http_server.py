"""An ASGI application served over HTTP/1.1 on the trio loop (hypercorn's trio worker).

Used by ``echorl serve`` (the Tinker-API endpoint): the listener lives here because sockets are
this package's business; the application is the caller's. Every read has a deadline
(``read_timeout``), idle keep-alive connections close after ``keep_alive_s``.
"""

from __future__ import annotations

from typing import Any

import trio

READ_TIMEOUT_S = 60
"""A client that sends nothing for this long is dropped (bodies are bounded by the app)."""


async def serve_asgi(
    app: Any,
    host: str,
    port: int,
    keep_alive_s: float = 75.0,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` until cancelled; ``task_status.started`` gets the bound
    URLs (``http://host:port``, the real port when ``port`` is 0)."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    cfg = Config()
    cfg.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    cfg.accesslog = None
    cfg.errorlog = None
    cfg.read_timeout = READ_TIMEOUT_S
    cfg.keep_alive_timeout = keep_alive_s
    cfg.graceful_timeout = 1.0
    await serve(app, cfg, task_status=task_status, mode="asgi")
