"""A learner and two nodes with ``--metrics-port``: ``/metrics`` answers with the documented
names and values that move; each node's receipts verify offline and add up to what the learner
credits that node with; ``echorl ledger`` and ``echorl status`` show accepted/rejected work and
cost; ``echorl plot`` draws the run."""

from __future__ import annotations

import csv
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from swarm import ENV
from test_swarm import learner_status

from echorl.node.receipts import verify_file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-zA-Z0-9_:]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "echorl.cli", *args],
        env={**ENV, "COLUMNS": "120"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def _credited(swarm, addr: str, nodes: dict, receipts: dict) -> tuple[dict, dict]:
    """(learner's groups per node, receipts' groups per node) at one instant: every node frozen,
    submissions in flight drained, files read; retried until no receipt is in transit."""
    for _ in range(20):
        for p in nodes.values():
            p.send_signal(signal.SIGSTOP)
        try:
            time.sleep(1.5)
            peers = {p["peer_id"]: p for p in learner_status(addr)["peers"]}
            mine = {
                name: sum(r.groups for r in verify_file(path).receipts) if path.exists() else 0
                for name, path in receipts.items()
            }
        finally:
            for p in nodes.values():
                p.send_signal(signal.SIGCONT)
        ids = {
            name: next(iter({r.peer_id for r in verify_file(path).receipts}), None) if path.exists() else None
            for name, path in receipts.items()
        }
        theirs = {name: peers[pid]["groups_accepted_total"] if pid in peers else None for name, pid in ids.items()}
        if theirs == mine and all(mine.values()):
            return theirs, mine
        time.sleep(0.5)
    raise AssertionError(f"learner {theirs} vs receipts {mine}")


def test_metrics_receipts_ledger_status_and_plot(swarm, tmp_path):
    lport, nport = _free_port(), _free_port()
    addr = swarm.start_learner(
        "--steps", "0", "--staleness", "2", "--eval-every", "5", "--metrics-port", str(lport), "--price-per-hour", "1.5"
    )
    learner_id = addr.rsplit("/", 1)[-1]
    receipts = {name: tmp_path / f"{name}.receipts.jsonl" for name in ("a", "b")}
    nodes = {
        "a": swarm.start_node(
            "a", "--price-per-hour", "0.2", "--metrics-port", str(nport), "--receipts", str(receipts["a"])
        ),
        "b": swarm.start_node("b", "--price-per-hour", "0.4", "--receipts", str(receipts["b"])),
    }
    swarm.wait_for(lambda: any(r.get("step", 0) >= 3 for r in swarm.metrics()), what="3 steps", timeout=180)
    first = _scrape(lport)
    swarm.wait_for(
        lambda: max(r["step"] for r in swarm.metrics()) >= first["echorl_learner_step"] + 3, what="3 more steps"
    )
    second = _scrape(lport)
    for name in (
        "echorl_learner_step",
        "echorl_rollouts_accepted_total",
        "echorl_learner_elapsed_seconds",
        'echorl_cost_total{part="learner"}',
        'echorl_cost_total{part="nodes"}',
    ):
        assert second[name] > first[name], name
    for name in (
        "echorl_staleness_max",
        "echorl_learner_busy_fraction",
        "echorl_learner_eval_reward",
        "echorl_signatures_verified_total",
        "echorl_receipts_issued_total",
        "echorl_nodes_active",
        "echorl_cost_per_step",
        "echorl_cost_per_1k_rollouts",
    ):
        assert name in second, name
    assert second["echorl_nodes_active"] == 2
    per_node = [k for k in second if k.startswith("echorl_node_groups_generated_total{peer=")]
    assert len(per_node) == 2 and any(k.startswith("echorl_broadcast_seconds{kind=") for k in second)
    node = _scrape(nport)
    assert node["echorl_node_groups_generated_total"] > 0 and node["echorl_node_receipts_total"] > 0
    assert node["echorl_node_receipts_invalid_total"] == 0

    theirs, mine = _credited(swarm, addr, nodes, receipts)
    assert theirs == mine

    res = _cli(
        "ledger",
        "--receipts",
        *map(str, receipts.values()),
        "--learner-id",
        learner_id,
        "--json",
        "--csv",
        str(tmp_path / "ledger.csv"),
    )
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)["rows"]
    assert len(rows) == 2 and all(r["groups_accepted"] >= mine[n] for r, n in zip(rows, ("a", "b")))
    assert len(list(csv.DictReader((tmp_path / "ledger.csv").open()))) == 2
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text(receipts["a"].read_text().replace('"receipt": "', '"receipt": "A', 1))
    assert _cli("ledger", "--receipts", str(tampered), "--learner-id", learner_id).returncode == 1

    res = _cli("ledger", "--bootstrap", addr, "--json")
    assert res.returncode == 0, res.stderr
    assert {r["peer_id"] for r in json.loads(res.stdout)["rows"]} == {p["peer_id"] for p in swarm.status()["peers"]}
    table = _cli("status", "--bootstrap", addr)
    assert table.returncode == 0 and "top reject" in table.stdout and "cost/step" in table.stdout
    print(table.stdout)
    (tmp_path / "status.txt").write_text(table.stdout)

    if pytest.importorskip("matplotlib"):
        res = _cli("plot", str(tmp_path / "m.jsonl"), "-o", str(tmp_path / "run.png"))
        assert res.returncode == 0 and (tmp_path / "run.png").stat().st_size > 10_000, res.stderr
