"""``echorl ledger``: who contributed what to a run.

``--bootstrap ADDR`` asks the learner (its ``Status``: per node accepted submissions, groups and
tokens, rejected submissions by reason, cost; and what was voided: the groups and cost of a node's
receipts that no replay verified, once the node was proven to cheat). ``--receipts FILE …`` needs no network: it
verifies every receipt a node kept (``node/receipts.py``) against the one learner pinned with
``--learner-id`` (required: a file of receipts a made-up learner signed for itself proves
nothing), counts each (learner, run, lease) once across all files, and sums what each node was
credited with, one row per run and node; a forged, altered, torn or repeated line is listed and
makes the exit status 1. ``--csv FILE`` also writes the table as CSV.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from typing import Any

import trio

COLUMNS = (
    "run",
    "node",
    "peer_id",
    "submissions_accepted",
    "groups_accepted",
    "tokens_accepted",
    "submissions_rejected",
    "top_rejection",
    "rejections",
    "cost",
    "groups_voided",
    "cost_voided",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bootstrap", help="multiaddr of a bootstrap peer: ask the learner")
    src.add_argument("--receipts", nargs="+", metavar="FILE", help="node receipts files to verify offline")
    p.add_argument(
        "--learner-id",
        dest="learner_id",
        default=None,
        help="with --receipts (required there): accept only receipts signed by this learner peer ID (the /p2p/ "
        "part of its address)",
    )
    p.add_argument(
        "--run-id",
        dest="run_id",
        default=None,
        help="with --bootstrap: the run (default: the one the learner serves; another one is an error)",
    )
    p.add_argument("--csv", default=None, metavar="FILE", help="also write the table as CSV")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds to wait for the learner (with --bootstrap)")


def from_status(status: dict[str, Any]) -> list[dict[str, Any]]:
    """Ledger rows from a ``Status`` (``echorl.cli.status.fetch_status``)."""
    from echorl.protocol.identity import short_id

    rows = []
    for p in status["peers"]:
        reasons = {k.removeprefix("rejected_"): v for k, v in p.items() if k.startswith("rejected_")}
        rows.append(
            {
                "run": status.get("run_id"),
                "node": short_id(p["peer_id"]),
                "peer_id": p["peer_id"],
                "submissions_accepted": p.get("submissions_accepted", p.get("leases_done")),
                "groups_accepted": p.get("groups_accepted_total", p.get("groups_accepted")),
                "tokens_accepted": p.get("tokens_accepted"),
                "submissions_rejected": p.get("submissions_rejected"),
                "top_rejection": p.get("top_rejection"),
                "rejections": " ".join(f"{k}={v}" for k, v in sorted(reasons.items())),
                "cost": p.get("cost"),
                "groups_voided": p.get("groups_voided"),
                "cost_voided": p.get("cost_voided"),
            }
        )
    return rows


def from_receipts(paths: list[str], learner_id: str) -> tuple[list[dict[str, Any]], list[str], set[str]]:
    """(rows per run and node, refused lines as ``FILE:LINE: reason``, learners the receipts verify
    against: the pinned one). A receipt for a (learner, run, lease) already counted, in this file
    or another, is refused as a duplicate."""
    from echorl.node.receipts import verify_file
    from echorl.protocol.identity import short_id

    rows: dict[tuple[str, str], dict[str, Any]] = {}
    counted: dict[tuple[str, str, str], str] = {}  # (learner, run, lease) -> where it was counted
    refused: list[str] = []
    learners: set[str] = set()
    for path in paths:
        result = verify_file(path, learner_id)
        refused += [f"{path}:{n}: {why}" for n, why in result.refused]
        learners |= result.learners()
        for n, r in zip(result.lines, result.receipts):
            key = (r.learner_peer_id, r.run_id, r.lease_id)
            if key in counted:
                refused.append(f"{path}:{n}: duplicate of {counted[key]} (lease {r.lease_id} of run {r.run_id})")
                continue
            counted[key] = f"{path}:{n}"
            row = rows.setdefault(
                (r.run_id, r.peer_id),
                {
                    "run": r.run_id,
                    "node": short_id(r.peer_id),
                    "peer_id": r.peer_id,
                    "submissions_accepted": 0,
                    "groups_accepted": 0,
                    "tokens_accepted": 0,
                    "submissions_rejected": None,
                    "top_rejection": None,
                    "rejections": "",
                    "cost": None,
                    "groups_voided": None,  # the learner voids, the receipts cannot say
                    "cost_voided": None,
                },
            )
            row["submissions_accepted"] += 1
            row["groups_accepted"] += r.groups
            row["tokens_accepted"] += r.tokens
    return list(rows.values()), refused, learners


def write_csv(rows: list[dict[str, Any]], path: str) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r.get(k) for k in COLUMNS})


def render(rows: list[dict[str, Any]], title: str) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from echorl.cli.status import show

    t = Table(title=title, box=box.SIMPLE)
    for col in ("run", "node", "subs ok", "groups", "tokens", "rejected", "top reason", "cost", "voided"):
        t.add_column(col, no_wrap=True, justify="left" if col in ("run", "node", "top reason") else "right")
    for r in rows:
        cost = r.get("cost")
        t.add_row(
            str(r.get("run") or "-"),
            r["node"],
            *(
                ("-" if r.get(k) is None else str(r[k]))
                for k in (
                    "submissions_accepted",
                    "groups_accepted",
                    "tokens_accepted",
                    "submissions_rejected",
                    "top_rejection",
                )
            ),
            "-" if cost is None else f"{cost:.4f}",
            "-" if r.get("groups_voided") is None else f"{r['groups_voided']} groups",
        )
    show(Console(), t)


async def _ask(args: argparse.Namespace) -> dict[str, Any]:
    from echorl.cli.status import OtherRun, fetch_status
    from echorl.net.host import HostConfig, PeerUnavailable, RemoteError, open_host
    from echorl.protocol.identity import Identity

    async with open_host(Identity.generate(), HostConfig()) as host:
        try:
            with trio.fail_after(args.timeout):
                return await fetch_status(host, None, args.bootstrap, args.run_id)
        except (PeerUnavailable, RemoteError, trio.TooSlowError, OtherRun) as exc:
            problem = exc  # raised once the host is closed: a plain exception, not a group
    raise problem


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    refused: list[str] = []
    run_id = None  # the run the learner says it serves (with --bootstrap)
    if args.receipts:
        if not args.learner_id:
            print(
                "echorl ledger: --receipts needs --learner-id: the learner whose signature makes a receipt count "
                "(the /p2p/ part of its address)",
                file=sys.stderr,
            )
            return 2
        try:
            rows, refused, learners = from_receipts(args.receipts, args.learner_id)
        except OSError as exc:
            print(f"echorl ledger: {exc}", file=sys.stderr)
            return 2
        title = f"receipts verified offline (learner {', '.join(sorted(learners)) or '-'})"
    else:
        from echorl.cli.status import OtherRun
        from echorl.net.host import PeerUnavailable, RemoteError

        try:
            status = trio.run(_ask, args)
        except (PeerUnavailable, RemoteError, trio.TooSlowError) as exc:
            print(f"echorl ledger: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        except OtherRun as exc:
            print(f"echorl ledger: {exc}", file=sys.stderr)
            return 2
        rows, run_id = from_status(status), status["run_id"]
        title = f"ledger of run {run_id} (from the learner)"
    if args.csv:
        write_csv(rows, args.csv)
    if args.json:
        print(json.dumps({"run_id": run_id, "rows": rows, "refused": refused}))
    else:
        render(rows, title)
        for line in refused:
            print(f"REFUSED {line}")
    return 1 if refused else 0
