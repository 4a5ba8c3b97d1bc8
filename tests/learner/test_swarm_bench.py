"""``bench/swarm.py`` runs end to end at N = 10 (issue 27's control-plane bench): real learner and
peer processes, the learner pinned to a core of its own, and the figures that tell the learner's
delay from the peers' (its loop lag from its status, the peer processes' own loop lag)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_swarm_bench_reports_the_learner_s_and_the_peers_own_loop_lag() -> None:
    pin = ["--learner-core", "0"] if len(os.sched_getaffinity(0)) > 1 else []
    cmd = [sys.executable, str(ROOT / "bench" / "swarm.py"), "--peers", "10", "--window", "4", "--settle-s", "2"]
    cmd += ["--idle-s", "1", "--warmup", "1", "--work-s", "0.5", "--json", *pin]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["peers"] == row["joined"] == 10 and row["errors"] == {}
    assert row["leases_per_s"] > 0 and row["submits_per_s"] > 0
    assert 0 <= row["learner_loop_lag_p50_ms"] <= row["learner_loop_lag_p99_ms"] <= row["learner_loop_lag_max_ms"]
    assert 0 <= row["peer_loop_lag_p50_ms"] <= row["peer_loop_lag_p99_ms"]
    assert row["learner_core"] == (0 if pin else None)
