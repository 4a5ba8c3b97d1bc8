"""Real processes on loopback: versions reach the nodes through the pipelined broadcast (deltas
and full snapshots) while training goes on; a learner stopped with SIGTERM checkpoints and a
``--resume`` continues the same run (same version numbers, first publication a full snapshot,
no prompt trained twice) on a new address, with the nodes that kept running."""

from __future__ import annotations

import json
import re
import signal

from swarm import Swarm


def _steps(swarm: Swarm) -> list[dict]:
    return [r for r in swarm.metrics() if r.get("step", 0) > 0]


def test_versions_arrive_by_broadcast_delta_and_full(swarm):
    # κ = S − 1 = 3: versions 0 (full), 3, 6 (deltas), 9 (full: every 3rd publication), ...
    swarm.start_learner(
        "--steps", "24", "--staleness", "4", "--full-every", "3", "--eval-every", "1000", "--log-level", "debug"
    )
    nodes = [swarm.start_node("a"), swarm.start_node("b")]
    swarm.wait_for(lambda: swarm.learner.poll() is not None, what="learner to finish", timeout=150)
    assert swarm.learner.returncode == 0
    rows = _steps(swarm)
    assert rows[-1]["step"] == 24 and rows[-1]["staleness_max"] <= 4 and rows[-1]["prompts_trained_twice"] == 0
    kinds = {r["broadcast_version"]: r["broadcast_kind"] for r in rows if r["broadcast_version"] is not None}
    assert "delta" in kinds.values() and "full" in kinds.values(), kinds
    assert all(v % 3 == 0 for v in kinds) and max(kinds) >= 15  # only κ-th versions are published
    assert all(isinstance(r["broadcast_seconds"], float) for r in rows if r["broadcast_version"] is not None)
    assert rows[-1]["publish_every"] == 3 and rows[-1]["t_bcast_s"] > 0
    # every node's version advances, and both contributed
    assert len(rows[-1]["per_node_version"]) == 2 and min(rows[-1]["per_node_version"].values()) >= 9
    assert all(v > 0 for v in rows[-1]["per_node_groups"].values())
    log = swarm.learner_log.read_text()
    assert re.search(r"broadcast v\d+ delta: 2/2 nodes", log) and re.search(r"broadcast v\d+ full: 2/2 nodes", log)
    for n in nodes:
        n.send_signal(signal.SIGTERM)
    for i, n in enumerate(nodes):
        assert n.wait(timeout=30) == 0
        loads = re.search(
            r"versions loaded: \{'relay': (\d+), 'fetch': (\d+)\}", (swarm.tmp / f"{'ab'[i]}.log").read_text()
        )
        assert loads and int(loads.group(1)) >= 3, "versions came through the relay"


def test_sigterm_checkpoints_and_resume_continues(swarm, tmp_path):
    ckpt = tmp_path / "ckpt"
    common = ["--staleness", "2", "--eval-every", "1000", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"]
    swarm.start_learner("--steps", "0", *common, log="learner1.log")
    swarm.start_node("a")
    swarm.start_node("b")
    swarm.wait_for(lambda: len(_steps(swarm)) >= 8 and (ckpt / "LATEST").exists(), what="8 steps", timeout=90)
    swarm.learner.send_signal(signal.SIGTERM)  # after a periodic checkpoint; it writes one more
    assert swarm.learner.wait(timeout=30) == 0
    first = _steps(swarm)
    v1 = first[-1]["version"]
    state = json.loads((ckpt / (ckpt / "LATEST").read_text().strip() / "state.json").read_text())
    assert state["version"] == v1 and state["extra"]["run_id"] == "echorl-demo"
    extra = state["extra"]  # assembled from the components' state_dicts
    assert {"loop", "buffer", "service", "publisher"} <= set(extra)
    pending = {p["prompt_id"] for p in extra["buffer"]["pending"]}
    trained = set(extra["loop"]["trained_prompt_ids"])
    assert not pending & trained and len(trained) == 16 * v1
    # nothing lost: every prompt handed out so far (cursor) is trained or pending (leased/buffered)
    assert {int(pid.rsplit(":", 1)[1]) for pid in pending | trained} == set(range(state["cursor"]))

    # resumed on another port: the nodes only know the old bootstrap address, so the learner
    # dials the nodes its checkpoint remembers and they re-join over that connection
    old_addr = swarm.addr
    assert (
        swarm.start_learner("--steps", str(v1 + 8), "--resume", *common, "--log-level", "debug", log="learner2.log")
        != old_addr
    )
    swarm.wait_for(lambda: swarm.learner.poll() is not None, what="resumed learner to finish", timeout=120)
    assert swarm.learner.returncode == 0
    second = _steps(swarm)[len(first) :]
    assert [r["version"] for r in second] == list(range(v1 + 1, v1 + 9))  # versions continue
    assert second[-1]["prompts_trained_twice"] == 0  # across both runs (ids kept in the checkpoint)
    log2 = swarm.learner_log.read_text()
    assert f"resumed run echorl-demo at version {v1}" in log2
    assert "re-dialled 2 of 2 nodes remembered by the checkpoint" in log2
    assert re.search(rf"broadcast v{v1} full", log2)  # the first publication after resume is full
    assert max(second[-1]["per_node_version"].values()) > v1  # the same nodes kept training
