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


def bench_lines(*args: str) -> list[dict]:
    """``bench/cheaters.py --json --prompts 4 --no-costs ARGS``: its JSON lines."""
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--prompts", "4", "--no-costs", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_cheat_lines_count_the_submissions_that_differ_from_honest_work():
    leases = 4
    rows = bench_lines("--only", "all_eos,bf16_weights", "--cheat-leases", str(leases), "--honest", "none")
    lines = {row["cheat"]: row for row in rows}
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


def test_honest_lines_say_what_each_replay_row_would_have_done():
    """An honest float32 node replays exactly (no gap, no flag under either row); a bf16 node is
    judged by the row it declares, and the line also says what the other row would have done."""
    rows = bench_lines("--only", "none", "--honest", "fp32,bf16", "--honest-samples", "96")
    lines = {row["honest"]: row for row in rows}
    fp32, bf16 = lines["fp32"], lines["bf16"]
    assert fp32["declared_dtype"] == "float32" and fp32["samples_checked"] == 96
    assert fp32["max_gap"] == 0.0 and fp32["false_flags"] == fp32["false_flags_strict_row"] == 0
    assert bf16["declared_dtype"] == "bfloat16" and bf16["false_flags"] == bf16["false_flags_loose_row"]
    assert bf16["max_gap"] > 0.0  # bf16 rounding moves some scores: the replay sees it


def test_the_loose_row_passes_every_honest_gpu_bf16_submission_of_the_h200_calibration():
    """The data behind ``PROOF_LOOSE`` (docs/data/h200-2026-12-04: SmolLM2-135M-Instruct, bf16
    nodes on an H200 against a float32 learner, two seeds): the current row flags none of the 314
    honest submissions; the first loose row, set on CPU bf16 and the tiny model, flagged 23."""
    from echorl.learner.tolerances import PROOF_LOOSE

    sys.path.insert(0, str(BENCH.parent))
    from cheaters import score_rows

    data = BENCH.parents[1] / "docs" / "data" / "h200-2026-12-04"
    row, first = (PROOF_LOOSE.gap, PROOF_LOOSE.miss_fraction, PROOF_LOOSE.miss_slack), (0.1, 0.005, 2)
    lines = [
        line
        for name in ("gaps_smollm2_seed0.json", "gaps_smollm2_seed1_bf16.json")
        for line in score_rows(data / name, [row, first])
        if line["honest"] == "bf16"
    ]
    assert sum(line["submissions"] for line in lines if line["row"] == list(row)) == 314
    assert all(line["false_flags"] == 0 for line in lines if line["row"] == list(row))
    assert sum(line["false_flags"] for line in lines if line["row"] == list(first)) > 0
