"""``scripts/gpu-check.sh`` on the CPU (how it is tested where there is no GPU): the steps that
ran on an H200 report what they measured, one JSON line each, as they finish."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_steps_report_noise_learner_and_replay_lines(tmp_path):
    import sys

    lines = tmp_path / "lines.jsonl"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check.sh"), "--device", "cpu", "--small", "--only", "noise,learner,proofs"]
        + ["--proof-samples", "64", "--lines", str(lines), "--gaps-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = {row["step"]: row for row in map(json.loads, lines.read_text().splitlines())}
    assert set(steps) == {"noise", "learner", "proofs"}
    noise = steps["noise"]
    assert noise["hash_bits_equal"] and noise["uniforms_equal"] and noise["tokens_equal"]
    assert steps["learner"]["cosine_float32_vs_cpu_fp32"] == 1.0
    assert steps["learner"]["cosine_bfloat16_vs_cpu_fp32"] > 0.99
    honest = {h["honest"]: h for h in steps["proofs"]["honest"]}
    assert set(honest) == {"fp32", "bf16"}  # TF32 exists on CUDA only
    assert honest["fp32"]["false_flags"] == 0 and honest["fp32"]["max_gap"] == 0.0
    gaps = json.loads((tmp_path / "gaps_proofs.json").read_text())
    assert sum(positions for positions, _ in gaps["fp32"]["submissions"]) == honest["fp32"]["positions"]
