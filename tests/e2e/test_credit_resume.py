"""Issue 28.1, with real processes on loopback: a learner stopped with SIGTERM and resumed with
``--resume`` keeps every node's credit. The learner's per-node figures (its checkpoint, its
summary, the node's own end-of-run line from the signed ``RunEnded``) equal what the node's
signed receipts add up to, across the restart; before, they restarted from zero."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

from swarm import Swarm

from echorl.node.receipts import verify_file
from echorl.protocol.identity import load_or_create_identity, short_id


def _steps(swarm: Swarm) -> list[dict]:
    return [r for r in swarm.metrics() if r.get("step", 0) > 0]


def _groups(receipts: Path) -> int:
    verified = verify_file(receipts)
    assert not verified.refused and len(verified.learners()) == 1, verified.refused
    return sum(r.groups for r in verified.receipts)


def test_node_credit_equals_its_receipts_across_a_learner_restart(swarm, tmp_path):
    ckpt, receipts = tmp_path / "ckpt", tmp_path / "a.receipts.jsonl"
    common = ["--staleness", "2", "--eval-every", "1000", "--checkpoint-dir", str(ckpt)]
    swarm.start_learner("--steps", "0", *common, log="learner1.log")
    node = swarm.start_node("a", "--receipts", str(receipts))
    swarm.wait_for(lambda: len(_steps(swarm)) >= 6, what="6 steps", timeout=120)
    swarm.learner.send_signal(signal.SIGTERM)
    assert swarm.learner.wait(timeout=60) == 0
    v1 = _steps(swarm)[-1]["version"]
    node_id = load_or_create_identity(str(tmp_path / "a.key")).peer_id
    state = json.loads((ckpt / (ckpt / "LATEST").read_text().strip() / "state.json").read_text())
    saved = state["extra"]["service"]
    before = _groups(receipts)
    assert before > 0 and saved["accounts"][node_id]["groups_accepted"] == before
    assert saved["receipts_issued"] == len(verify_file(receipts).receipts)

    swarm.start_learner("--steps", str(v1 + 6), "--resume", *common, log="learner2.log")
    swarm.wait_for(lambda: swarm.learner.poll() is not None, what="resumed learner to finish", timeout=180)
    assert swarm.learner.returncode == 0
    assert node.wait(timeout=60) == 0  # told the run is over
    total = _groups(receipts)
    assert total > before  # the node kept working for the resumed learner
    log2 = swarm.learner_log.read_text()
    assert "restored the accounts of 1 nodes" in log2
    summary = re.search(rf"nodes: {short_id(node_id)} (\d+) groups", log2)  # printed once the host closed
    assert summary and int(summary.group(1)) == total, log2[-2000:]
    node_log = (tmp_path / "a.log").read_text()
    ended = re.search(r"this node contributed \d+ leases, (\d+) rollout groups accepted", node_log)
    # the RunEnded counts the whole run (a submission still in flight may be credited after it)
    assert ended and total - before < int(ended.group(1)) <= total, node_log[-2000:]
