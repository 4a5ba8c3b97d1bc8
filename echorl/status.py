"""``echorl status``: peers, versions, throughput and staleness of a run, from any machine that
can reach one bootstrap peer. Finds the learner through the DHT's signed learner record (or
the bootstrap peer itself), asks it for ``Status``, and lists the nodes the DHT knows as
providers of the run. ``--json`` prints one object; ``--watch`` refreshes a rich table."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

import trio

from echorl.protocol.identity import short_id


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bootstrap", required=True, help="multiaddr of any bootstrap peer of the run")
    p.add_argument("--run-id", dest="run_id", default="echorl-demo", help="the run to inspect")
    p.add_argument("--json", action="store_true", help="print one machine-readable object")
    p.add_argument("--watch", action="store_true", help="refresh every --interval seconds")
    p.add_argument("--interval", type=float, default=2.0, help="refresh period of --watch, seconds")
    p.add_argument("--timeout", type=float, default=20.0, help="give up after this many seconds without an answer")


def run(args: argparse.Namespace) -> int:
    from echorl.net.addrs import AddressError, parse_peer_addr

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        args.bootstrap = parse_peer_addr(args.bootstrap)
    except AddressError as exc:
        print(f"echorl status: {exc}", file=sys.stderr)
        return 2
    try:
        return trio.run(_main, args)
    except KeyboardInterrupt:
        return 130


async def fetch_status(host: Any, membership: Any, bootstrap: str, run_id: str) -> dict[str, Any]:
    from echorl.protocol.messages import Status, StatusRequest

    from echorl.protocol import routes
    from echorl.net.membership import find_learner

    learner = await find_learner(host, bootstrap, run_id, membership)
    peers: list[dict[str, Any]] = []
    cursor: int | None = 0
    while cursor is not None and len(peers) < MAX_PEERS_SHOWN:  # the status in pages (a cursor)
        reply = await host.request(learner, routes.STATUS, StatusRequest(cursor=cursor), expect=Status)
        assert isinstance(reply, Status)
        peers += [dict(p) for p in reply.peers]
        cursor = reply.next_cursor if reply.next_cursor is not None and reply.next_cursor > cursor else None
    dht_nodes = await membership.find_nodes(timeout=5.0) if membership is not None else []
    return {"run_id": reply.run_id, "learner": dict(reply.learner), "peers": peers,
            "dht_nodes": dht_nodes, "fetched_at": time.time()}


async def _main(args: argparse.Namespace) -> int:
    from echorl.protocol.identity import Identity

    from echorl.net.host import HostConfig, PeerUnavailable, RemoteError, open_host
    from echorl.net.membership import Membership

    async with open_host(Identity.generate(), HostConfig()) as host:
        async with trio.open_nursery() as nursery:
            membership = Membership(host, args.run_id, server=False)
            await nursery.start(membership.run)
            try:
                while True:
                    with trio.fail_after(args.timeout):
                        status = await fetch_status(host, membership, args.bootstrap, args.run_id)
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
            finally:
                nursery.cancel_scope.cancel()
    return 0


def _fmt(v: Any, nd: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


MAX_PEERS_SHOWN = 100_000  # pages fetched at most (a learner's peer table is bounded far below)

LEARNER_FIELDS = (
    ("peer", "peer_id"), ("step", "step"), ("version", "version"), ("S", "staleness_bound"),
    ("buffer", "buffer"), ("busy", "busy_fraction"), ("reward", "reward_mean"), ("eval", "eval_reward"),
    ("required μ/s", "required_rollouts_per_s"), ("available μ/s", "available_rollouts_per_s"),
    ("leases", "leases_active"), ("expired", "leases_expired"), ("signatures ok", "signatures_verified"),
    ("invalid", "rollouts_rejected_invalid"), ("logprob lies", "rollouts_rejected_logprob"),
    ("broadcast s", "broadcast_seconds"), ("receipts", "receipts_issued"), ("rejected", "submissions_rejected_total"),
    ("cost", "cost_total"), ("cost learner", "cost_learner"), ("cost nodes", "cost_nodes"),
    ("cost/step", "cost_per_step"), ("cost/1k rollouts", "cost_per_1k_rollouts"),
    ("learner-only est.", "cost_rollouts_on_learner_estimate"),
)


def render(status: dict[str, Any], clear: bool = False) -> None:
    """Two tables that fit 80 columns: the learner as field/value pairs, one row per node."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if clear:
        console.clear()
    learner = status["learner"]
    cells = [(name, short_id(learner.get("peer_id") or "") if key == "peer_id" else _fmt(learner.get(key), 3))
             for name, key in LEARNER_FIELDS if key in learner or key == "peer_id"]
    lt = Table(title=f"learner of run {status['run_id']}", box=box.SIMPLE, show_header=False)
    for _ in range(2):
        lt.add_column(style="bold")
        lt.add_column(justify="right")
    half = (len(cells) + 1) // 2
    for left, right in zip(cells[:half], cells[half:] + [("", "")]):
        lt.add_row(*left, *right)
    console.print(lt)
    pt = Table(title=f"nodes ({len(status['peers'])} joined, {len(status['dht_nodes'])} in the DHT)", box=box.SIMPLE)
    for col in ("peer", "device", "ver", "grp/s", "acc", "rej", "top reject", "seen", "$/h", "cost"):
        pt.add_column(col, no_wrap=True, justify="left" if col in ("peer", "device", "top reject") else "right")
    for p in status["peers"]:
        seen = f"{_fmt(p['last_seen_s'], 1)}s" if p.get("alive") else "dead"
        pt.add_row(short_id(p["peer_id"]), f"{p['engine']}/{p['device']}"[:10], _fmt(p["version"]),
                   _fmt(p.get("rollouts_per_s"), 1), _fmt(p.get("groups_accepted")),
                   _fmt(p.get("submissions_rejected")), _fmt(p.get("top_rejection"))[:16], seen,
                   _fmt(p["price_per_hour"]), _fmt(p.get("cost"), 4))
    console.print(pt)

