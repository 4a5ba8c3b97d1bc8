"""Real processes: a learner resumed from an *older* checkpoint abandons the versions it had
published after it, and signs new ones under the same numbers. A node that held a newer version
of the abandoned branch (on disk, restarted) must not serve it or lease against it: the new
learner process has a new incarnation, so the node drops that version on joining and catches up
to the new branch."""

from __future__ import annotations

import re
import shutil
import signal

from echorl.protocol import wire


def _max(swarm, key: str, since: int = 0) -> int:
    return max([r[key] for r in swarm.metrics()[since:] if isinstance(r.get(key), int)] or [-1])


def test_node_of_an_abandoned_branch_drops_it_and_catches_up(swarm, tmp_path):
    ckpt, old = tmp_path / "ckpt", tmp_path / "ckpt-old"
    common = ["--staleness", "2", "--eval-every", "1000", "--checkpoint-every", "2"]
    swarm.start_learner("--steps", "0", "--checkpoint-dir", str(ckpt), *common, log="learner1.log")
    node_args = ["--state-dir", str(tmp_path / "a-state")]
    a = swarm.start_node("a", *node_args)
    swarm.wait_for(lambda: (ckpt / "LATEST").exists(), what="a checkpoint", timeout=120)
    shutil.copytree(ckpt, old)  # the older checkpoint the learner will go back to
    v_old = int(re.search(r"\d+", (old / "LATEST").read_text()).group())
    swarm.wait_for(lambda: _max(swarm, "broadcast_version") >= v_old + 3, what="3 newer versions", timeout=120)
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=30) == 0  # it keeps its newest version on disk
    held = max(int(p.stem[1:]) for p in (tmp_path / "a-state").glob("v*.manifest"))
    assert held > v_old
    swarm.learner.send_signal(signal.SIGTERM)
    assert swarm.learner.wait(timeout=30) == 0

    rows_before = len(swarm.metrics())
    swarm.start_learner("--steps", "0", "--resume", "--checkpoint-dir", str(old), *common, log="learner2.log")
    log2 = swarm.learner_log.read_text()
    incarnation = re.search(r"learner incarnation ([0-9a-f]{32})", log2).group(1)
    swarm.start_node("b")  # trains the new branch past the abandoned branch's version numbers
    swarm.wait_for(
        lambda: _max(swarm, "broadcast_version", rows_before) >= held,
        what=f"the new branch to publish v{held}",
        timeout=180,
    )
    receipts = tmp_path / "a-state" / "receipts.jsonl"
    receipts_before = len(receipts.read_text().splitlines()) if receipts.exists() else 0
    swarm.start_node("a", *node_args, log="a2.log")  # restarted with the abandoned branch's v{held} on disk

    def a_contributed() -> bool:  # a receipt of the new branch (the resumed learner's accounts
        # keep what node a did before, so its groups_accepted is > 0 from the start)
        return receipts.exists() and len(receipts.read_text().splitlines()) > receipts_before

    swarm.wait_for(a_contributed, what="node a's work accepted by the new branch", timeout=180)
    swarm.stop()
    a_log = (tmp_path / "a2.log").read_text()
    assert f"resumed from on-disk snapshot v{held}" in a_log
    assert f"the learner restarted (new incarnation): v{held} is of the branch it left" in a_log
    manifests = sorted((tmp_path / "a-state").glob("v*.manifest"))
    assert manifests, "node a keeps the new branch's version on disk"
    kept = wire.decode(manifests[-1].read_bytes())
    assert kept.incarnation.hex() == incarnation  # the new branch's, not the abandoned one
    rows = swarm.metrics()[rows_before:]
    assert rows and rows[-1].get("rollouts_rejected_logprob", 0) == 0
