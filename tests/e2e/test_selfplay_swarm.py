"""Self-play over the network: after each evaluation the learner deals poker episodes against the
mean of the policy's last 8 snapshots; the node runs each prompt against the opponent its lease
names, and every episode it returns replays on the learner (none refused as a mismatch, all
checked)."""

from __future__ import annotations


def test_self_play_episodes_run_on_a_node_and_replay_on_the_learner(swarm):
    swarm.start_learner(
        *("--task", "poker", "--task-option", "self_play=8", "--task-option", "n_eval=16"),
        *("--steps", "6", "--staleness", "1", "--prompts-per-step", "4", "--prompts-per-lease", "2"),
        *("--eval-every", "2", "--spot-check-fraction", "1"),
    )
    node = swarm.start_node("a")
    swarm.wait_for(lambda: swarm.learner.poll() is not None, timeout=240, what="learner to finish")
    assert swarm.learner.returncode == 0
    rows = [r for r in swarm.metrics() if r["step"] > 0]
    last = rows[-1]
    assert last["step"] == 6 and last["rollouts_accepted"] >= 24
    # steps 3..6 trained on prompts dealt after the step-2 snapshot (S = 1 leases nothing older)
    assert [r["self_play_snapshots"] for r in rows if "self_play_snapshots" in r] == [2, 3, 4]
    assert last["rollouts_rejected_env"] == 0 and last["rollouts_rejected_logprob"] == 0
    assert node.wait(timeout=60) == 0
