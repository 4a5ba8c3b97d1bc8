"""``echorl status``: peers, versions, throughput and staleness of a run, from any machine that
can reach one bootstrap peer. Finds the learner through the DHT's signed learner record (or
the bootstrap peer itself), asks it for ``Status``, and lists the nodes the DHT knows as
providers of the run. ``--json`` prints one object; ``--watch`` refreshes a rich table. Without
``--run-id`` it shows the run the learner serves (named in the title); with one, a learner serving
another run is a one-line error (exit 2) that names it. Throughput is in rollout groups per second
(``groups/s``), the unit of every ``*rollouts_per_s`` metric. Tables are as wide as their
columns (never cut at 80 characters when piped). ``--serve URL`` shows instead what the caller's
sessions on an ``echorl serve`` endpoint used (``cli/serve_status.py``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from typing import Any

import trio

from echorl.protocol.identity import short_id


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", help="multiaddr of any bootstrap peer of the run")
    p.add_argument("--serve", metavar="URL", help="an echorl serve endpoint: your sessions' usage")
    p.add_argument("--api-key-file", help="with --serve: file holding your API key (default: $TINKER_API_KEY)")
    p.add_argument(
        "--run-id", dest="run_id", default=None, help="the run to inspect (default: the one the learner serves)"
    )
    p.add_argument("--json", action="store_true", help="print one machine-readable object")
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds")
    p.add_argument("--interval", type=float, default=2.0, help="refresh period of --watch, seconds")
    p.add_argument("--timeout", type=float, default=20.0, help="give up after this many seconds without an answer")


def run(args: argparse.Namespace) -> int:
    from echorl.net.addrs import AddressError, parse_peer_addr

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.serve:
        from echorl.cli import serve_status

        return serve_status.run(args.serve, args.api_key_file, args.json, args.timeout)
    if not args.bootstrap:
        print("echorl status: give --bootstrap MULTIADDR (a run) or --serve URL (an echorl serve)", file=sys.stderr)
        return 2
    try:
        args.bootstrap = parse_peer_addr(args.bootstrap)
    except AddressError as exc:
        print(f"echorl status: {exc}", file=sys.stderr)
        return 2
    try:
        return trio.run(_main, args)
    except BaseException as exc:
        if interrupted(exc):  # Ctrl-C leaves --watch quietly
            return 130
        raise


def interrupted(exc: BaseException) -> bool:
    """Ctrl-C, also as trio may deliver it: inside a task group, as a group of KeyboardInterrupts
    (and the cancellations it caused)."""
    if isinstance(exc, BaseExceptionGroup):
        _, rest = exc.split((KeyboardInterrupt, trio.Cancelled))
        return rest is None and exc.subgroup(KeyboardInterrupt) is not None
    return isinstance(exc, KeyboardInterrupt)


class OtherRun(Exception):
    """The learner serves another run than the ``--run-id`` asked for (a usage error: exit 2)."""


def check_run(served: str, asked: str | None, bootstrap: str) -> None:
    """Raise :class:`OtherRun`, naming the served run, unless it is the one asked for (or none was)."""
    if asked and served != asked:
        raise OtherRun(
            f"the learner at {bootstrap} serves run {served!r}, not {asked!r}: use --run-id {shlex.quote(served)} "
            "(or leave --run-id out)"
        )


async def served_run(host: Any, bootstrap: str) -> str:
    """The run the bootstrap peer's learner serves (its public ``Status``)."""
    from echorl.protocol import routes
    from echorl.protocol.messages import Status, StatusRequest

    learner = await host.connect(bootstrap)
    reply = await host.request(learner, routes.STATUS, StatusRequest(), expect=Status)
    assert isinstance(reply, Status)
    return reply.run_id


async def fetch_status(host: Any, membership: Any, bootstrap: str, run_id: str | None) -> dict[str, Any]:
    """The learner's status, every page of peers; :class:`OtherRun` if it serves another run
    than ``run_id`` (None: whichever it serves)."""
    from echorl.net.membership import find_learner
    from echorl.protocol import routes
    from echorl.protocol.messages import Status, StatusRequest

    learner = await find_learner(host, bootstrap, run_id or "", membership)
    peers: list[dict[str, Any]] = []
    cursor: int | None = 0
    while cursor is not None and len(peers) < MAX_PEERS_SHOWN:  # the status in pages (a cursor)
        reply = await host.request(learner, routes.STATUS, StatusRequest(cursor=cursor), expect=Status)
        assert isinstance(reply, Status)
        check_run(reply.run_id, run_id, bootstrap)
        peers += [dict(p) for p in reply.peers]
        cursor = reply.next_cursor if reply.next_cursor is not None and reply.next_cursor > cursor else None
    dht_nodes = await membership.find_nodes(timeout=5.0) if membership is not None else []
    return {
        "run_id": reply.run_id,
        "learner": dict(reply.learner),
        "peers": peers,
        "dht_nodes": dht_nodes,
        "fetched_at": time.time(),
    }


LEAVE_GRACE_S = 10.0
"""After Ctrl-C, ``--watch`` closes its libp2p host and exits 130; should that close hang (a peer
that never answers it on a loaded machine: once seen in a test run, 120 s), the process leaves
anyway after this long. A watch holds nothing that could be lost."""


async def _main(args: argparse.Namespace) -> int:
    """``_show``; with ``--watch``, Ctrl-C leaves it (exit 130) within ``LEAVE_GRACE_S``."""
    code = 130  # unless _show returns
    async with trio.open_nursery() as guard:
        if args.watch:  # started: Ctrl-C is caught before the watch begins
            await guard.start(_leave_on_ctrl_c, guard.cancel_scope)
        code = await _show(args)
        guard.cancel_scope.cancel()
    return code


async def _leave_on_ctrl_c(
    scope: trio.CancelScope, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        task_status.started()
        async for _ in signals:
            timer = threading.Timer(LEAVE_GRACE_S, os._exit, (130,))
            timer.daemon = True
            timer.start()
            scope.cancel()
            return


async def _show(args: argparse.Namespace) -> int:
    from echorl.net.host import HostConfig, PeerUnavailable, RemoteError, open_host
    from echorl.net.membership import Membership
    from echorl.protocol.identity import Identity

    async with open_host(Identity.generate(), HostConfig()) as host:
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(args.timeout):
                    run_id = args.run_id or await served_run(host, args.bootstrap)
                membership = Membership(host, run_id, server=False)  # the run's providers in the DHT
                await nursery.start(membership.run)
                while True:
                    with trio.fail_after(args.timeout):
                        status = await fetch_status(host, membership, args.bootstrap, run_id)
                    if args.json:
                        print(json.dumps(status), flush=True)
                    else:
                        render(status, clear=args.watch)
                    if not args.watch:
                        break
                    await trio.sleep(args.interval)
            except (PeerUnavailable, RemoteError, trio.TooSlowError) as exc:
                print(f"echorl status: {exc}", file=sys.stderr)
                return 1
            except OtherRun as exc:
                print(f"echorl status: {exc}", file=sys.stderr)
                return 2
            finally:
                nursery.cancel_scope.cancel()
    return 0


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


UNBOUNDED_COLUMNS = 10_000  # what a table is measured against: wider than any it draws
MAX_PEERS_SHOWN = 100_000  # pages fetched at most (a learner's peer table is bounded far below)

LEARNER_FIELDS = (
    ("peer", "peer_id"),
    ("step", "step"),
    ("version", "version"),
    ("S", "staleness_bound"),
    ("buffer", "buffer"),
    ("busy", "busy_fraction"),
    ("reward", "reward_mean"),
    ("eval", "eval_reward"),
    ("required groups/s", "required_rollouts_per_s"),
    ("available groups/s", "available_rollouts_per_s"),
    ("leases", "leases_active"),
    ("expired", "leases_expired"),
    ("signatures ok", "signatures_verified"),
    ("invalid", "rollouts_rejected_invalid"),
    ("logprob lies", "rollouts_rejected_logprob"),
    ("broadcast s", "broadcast_seconds"),
    ("loop lag p99 ms", "loop_lag_p99_ms"),
    ("receipts", "receipts_issued"),
    ("rejected", "submissions_rejected_total"),
    ("cost", "cost_total"),
    ("cost learner", "cost_learner"),
    ("cost nodes", "cost_nodes"),
    ("cost/step", "cost_per_step"),
    ("cost/1k rollouts", "cost_per_1k_rollouts"),
    ("learner-only est.", "cost_rollouts_on_learner_estimate"),
)


def render(status: dict[str, Any], clear: bool = False) -> None:
    """Two tables: the learner as field/value pairs, one row per node (throughput in groups/s)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if clear:
        console.clear()
    learner = status["learner"]
    cells = [
        (name, short_id(learner.get("peer_id") or "") if key == "peer_id" else _fmt(learner.get(key), 3))
        for name, key in LEARNER_FIELDS
        if key in learner or key == "peer_id"
    ]
    lt = Table(title=f"learner of run {status['run_id']}", box=box.SIMPLE, show_header=False)
    for _ in range(2):
        lt.add_column(style="bold")
        lt.add_column(justify="right")
    half = (len(cells) + 1) // 2
    for left, right in zip(cells[:half], cells[half:] + [("", "")]):
        lt.add_row(*left, *right)
    show(console, lt)
    pt = Table(title=f"nodes ({len(status['peers'])} joined, {len(status['dht_nodes'])} in the DHT)", box=box.SIMPLE)
    for col in ("peer", "device", "ver", "groups/s", "acc", "rej", "top reject", "seen", "$/h", "cost"):
        pt.add_column(col, no_wrap=True, justify="left" if col in ("peer", "device", "top reject") else "right")
    for p in status["peers"]:
        seen = f"{_fmt(p['last_seen_s'], 1)}s" if p.get("alive") else "dead"
        pt.add_row(
            short_id(p["peer_id"]),
            f"{p['engine']}/{p['device']}"[:10],
            _fmt(p["version"]),
            _fmt(p.get("rollouts_per_s"), 1),
            _fmt(p.get("groups_accepted")),
            _fmt(p.get("submissions_rejected")),
            _fmt(p.get("top_rejection"))[:16],
            seen,
            _fmt(p["price_per_hour"]),
            _fmt(p.get("cost"), 4),
        )
    show(console, pt)


def show(console: Any, table: Any) -> None:
    """Print ``table`` at its natural width, never cut or squeezed to the console's (80 columns
    when piped, or a narrow terminal's: a wider line wraps instead of losing its columns)."""
    natural = console.measure(table, options=console.options.update_width(UNBOUNDED_COLUMNS)).maximum
    console.width = max(console.width, natural)
    console.print(table)
