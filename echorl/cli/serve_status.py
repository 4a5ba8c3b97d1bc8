"""``echorl status --serve URL``: what the caller's sessions on an ``echorl serve`` endpoint used.

Asks ``GET /api/v1/echorl/usage`` with the caller's API key (``--api-key-file`` or
``TINKER_API_KEY`` / ``LOGITS_API_KEY``, as the clients read it) and prints one row per live
session: requests, tokens sampled / trained / forward, compute seconds, cost (``--json``: the
answer as one object). A key sees only its own user's sessions (the operator sees every session
and user on ``echorl serve --metrics-port``). The answer is read with a deadline and a size cap.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

MAX_ANSWER_BYTES = 4 << 20
"""A usage answer is a row per session (at most ``--max-sessions``): far below this."""
KEY_ENV = ("TINKER_API_KEY", "LOGITS_API_KEY")
COLUMNS = (
    ("session", "session"),
    ("models", "models"),
    ("requests", "requests"),
    ("sampled", "tokens_sampled"),
    ("by nodes", "tokens_sampled_by_nodes"),
    ("trained", "tokens_trained"),
    ("forward", "tokens_forward"),
    ("compute s", "compute_s"),
    ("cost", "cost"),
)


class UsageError(Exception):
    """No answer, or a refusal: one line (exit 1; a missing key is exit 2)."""


def api_key(key_file: str | None) -> str | None:
    if key_file:
        words = Path(key_file).read_text().split()
        return words[0] if words else None
    return next((os.environ[k] for k in KEY_ENV if os.environ.get(k)), None)


def fetch_usage(url: str, key: str, timeout_s: float) -> dict[str, Any]:
    """The caller's sessions from ``GET {url}/api/v1/echorl/usage``."""
    req = urllib.request.Request(url.rstrip("/") + "/api/v1/echorl/usage", headers={"X-API-Key": key})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as answer:
            raw = answer.read(MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as exc:
        detail = exc.read(4096).decode(errors="replace")
        try:
            detail = json.loads(detail).get("detail", detail)
        except (ValueError, AttributeError):
            pass
        raise UsageError(f"{url} answered {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise UsageError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    if len(raw) > MAX_ANSWER_BYTES:
        raise UsageError(f"{url}: usage answer over {MAX_ANSWER_BYTES} bytes")
    try:
        body = json.loads(raw)
    except ValueError:
        raise UsageError(f"{url}: the usage answer is not JSON (is it an echorl serve endpoint?)") from None
    if not isinstance(body, dict) or not isinstance(body.get("sessions"), list):
        raise UsageError(f"{url}: the usage answer has no sessions list")
    return body


def render(url: str, body: dict[str, Any]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from .status import _fmt, show

    sessions = [s for s in body["sessions"] if isinstance(s, dict)]
    user = sessions[0].get("user", "") if sessions else ""
    table = Table(title=f"sessions of {user or 'this key'} on {url}", box=box.SIMPLE)
    for name, _ in COLUMNS:
        table.add_column(name, no_wrap=True, justify="left" if name == "session" else "right")
    for s in sessions:
        table.add_row(*(_fmt(s.get(key), 4 if key == "cost" else 2) for _, key in COLUMNS))
    show(Console(), table)


def run(url: str, key_file: str | None, as_json: bool, timeout_s: float) -> int:
    try:
        key = api_key(key_file)
    except OSError as exc:
        print(f"echorl status: cannot read --api-key-file: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if not key:
        print(f"echorl status: --serve needs an API key: --api-key-file FILE or {KEY_ENV[0]}", file=sys.stderr)
        return 2
    try:
        body = fetch_usage(url, key, timeout_s)
    except UsageError as exc:
        print(f"echorl status: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps({"serve": url, **body}), flush=True)
    else:
        render(url, body)
    return 0
