"""``bench/cheaters.py`` compares every cheat submission with the honest float32 node's
submission for the same lease and seed: a caught submission always differs from the honest one
(identical work is never refused), and a fake that shares no token with the lease's samples
differs every time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cheaters.py"


def test_cheat_lines_count_the_submissions_that_differ_from_honest_work():
    leases = 4
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--only", "all_eos,bf16_weights", "--prompts", "4"]
        + ["--cheat-leases", str(leases), "--honest", "none", "--no-costs"],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr
    lines = {row["cheat"]: row for row in map(json.loads, proc.stdout.splitlines())}
    eos = lines["all_eos"]
    assert eos["submissions_differing"] == leases and eos["detected_frac_of_differing"] == 1.0
    assert eos["passed_identical_frac"] is None and eos["samples_per_differing_submission"] > 0
    rounded = lines["bf16_weights"]
    caught = round(rounded["detected_frac"] * leases)
    differing = rounded["submissions_differing"]
    assert 0 <= differing <= leases
    # every caught submission is one that differs (the honest node's own work always passes)
    assert caught == round((rounded["detected_frac_of_differing"] or 0.0) * differing)
    if caught < leases:
        passed = leases - caught
        assert round(rounded["passed_identical_frac"] * passed) == passed - (differing - caught)
