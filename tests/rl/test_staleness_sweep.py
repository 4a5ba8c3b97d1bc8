"""The staleness sweep bench runs end to end and prints one JSON line per (S, correction)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "staleness_sweep.py"


def test_sweep_prints_a_line_per_staleness_with_its_s0_baseline(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--json",
            "--staleness",
            "2",
            "--seeds",
            "0",
            "--steps",
            "3",
            "--correction",
            "on",
            "--metrics-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["staleness"] for r in rows] == [0, 2]
    for r in rows:
        assert 0.0 <= r["eval_final_mean"] <= 1.0 and r["steps_per_s"] > 0
        assert 0.0 < r["busy_fraction"] <= 1.0
        assert r["baseline_S0_eval_final_mean"] == rows[0]["eval_final_mean"]
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == ["S0-seed0-corr.jsonl", "S2-seed0-corr.jsonl"]

    out = tmp_path / "sweep.jsonl"
    out.write_text(proc.stdout)
    png = tmp_path / "sweep.png"
    rep = subprocess.run(
        [sys.executable, str(BENCH), "--report", str(out), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rep.returncode == 0, rep.stderr[-2000:]
    table = [line for line in rep.stdout.splitlines() if line.startswith("| 2 | on |")]
    assert len(table) == 1 and png.stat().st_size > 10_000
