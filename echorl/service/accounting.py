"""What each session and each user of ``echorl serve`` used, as a metrics row for ``/metrics``.

The figures are counted where requests complete (:meth:`SessionBook.charge`: requests, tokens
sampled / trained / forward, compute seconds, cost); this module only reads them. The row holds
totals since start (ended sessions included: the per-user totals outlive sessions), and two
maps per figure: ``session_<figure>`` (live sessions, by id) and ``user_<figure>`` (by user name
from the key file). ``echorl serve --metrics-port`` exports it (``common/metrics_sinks.py``,
role ``serve``; names in docs/metrics.md); ``echorl status --serve URL`` shows the caller's own
sessions from ``GET /api/v1/echorl/usage``.
"""

from __future__ import annotations

from typing import Any

import trio

from echorl.common.metrics_sinks import SERVE_USAGE_KEYS

from .sessions import SessionBook, Usage

EXPORT_EVERY_S = 2.0
"""How often the row is handed to the sinks: a scrape is at most this stale (scrapes are ~15 s)."""


def usage_row(book: SessionBook) -> dict[str, Any]:
    """Totals, and each live session's and each user's figures (``SERVE_USAGE_KEYS``)."""
    total = Usage()
    for u in book.by_user.values():
        for key in SERVE_USAGE_KEYS:
            setattr(total, key, getattr(total, key) + getattr(u, key))
    row: dict[str, Any] = {"sessions_live": len(book.sessions), **total.as_dict()}
    for key in SERVE_USAGE_KEYS:
        row[f"session_{key}"] = {s.ident: getattr(s.usage, key) for s in book.sessions.values()}
        row[f"user_{key}"] = {user: getattr(u, key) for user, u in book.by_user.items()}
    return row


async def export(book: SessionBook, sinks: list[Any], every_s: float = EXPORT_EVERY_S) -> None:
    """Forever: the newest row to every sink (a dict swap each: nothing heavy on the loop)."""
    while True:
        row = usage_row(book)
        for sink in sinks:
            sink.write(row)
        await trio.sleep(every_s)
