"""The metrics sinks export the row they are given under the documented names (docs/metrics.md),
and ``echorl plot`` draws a PNG from metrics files (echorl/metrics_sinks.py, echorl/plot.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from echorl.common.metrics_sinks import (
    LEARNER_LABELLED,
    LEARNER_SCALARS,
    NODE_SCALARS,
    SERVE_LABELLED,
    SERVE_SCALARS,
    PrometheusSink,
    parse_listen,
)

ROOT = Path(__file__).resolve().parents[2]


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^([a-zA-Z0-9_:]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def test_prometheus_sink_exports_the_row_and_keeps_last_values() -> None:
    sink = PrometheusSink("learner", "127.0.0.1:0")
    try:
        sink.write(
            {
                "step": 3,
                "rollouts_accepted": 48,
                "eval_reward": 0.25,
                "staleness_max": 2,
                "submissions_rejected_by_reason": {"stale_version": 2},
                "cost_by_part": {"learner": 0.5, "nodes": 1.5},
                "broadcast_seconds_by_kind": {"full": 1.25},
                "per_node_groups": {"abcdefgh": 40},
            }
        )
        sink.write(
            {
                "step": 4,
                "rollouts_accepted": 64,
                "broadcast_seconds_by_kind": {"delta": 0.5},
                "loss": float("nan"),
                "per_node_groups": {"abcdefgh": 56},
            }
        )
        got = _scrape(sink.port)
    finally:
        sink.close()
    assert got["echorl_learner_step"] == 4 and got["echorl_rollouts_accepted_total"] == 64
    assert got["echorl_learner_eval_reward"] == 0.25  # not in the newest row: the last value stays
    assert got['echorl_submissions_rejected_total{reason="stale_version"}'] == 2
    assert got['echorl_broadcast_seconds{kind="full"}'] == 1.25 and got['echorl_broadcast_seconds{kind="delta"}'] == 0.5
    assert got['echorl_cost_total{part="nodes"}'] == 1.5
    assert got['echorl_node_groups_accepted_total{peer="abcdefgh"}'] == 56
    assert "echorl_learner_loss" not in got  # NaN is not exported


def test_serve_sink_shows_live_sessions_only() -> None:
    sink = PrometheusSink("serve", "127.0.0.1:0")
    try:
        sink.write({"sessions_live": 2, "tokens_sampled": 9, "session_tokens_sampled": {"s-a": 4, "s-b": 5}})
        sink.write({"sessions_live": 1, "tokens_sampled": 9, "session_tokens_sampled": {"s-b": 5}})
        got = _scrape(sink.port)
    finally:
        sink.close()
    assert got["echorl_serve_sessions"] == 1 and got["echorl_serve_tokens_sampled_total"] == 9
    assert got['echorl_serve_session_tokens_sampled_total{session="s-b"}'] == 5
    assert 'echorl_serve_session_tokens_sampled_total{session="s-a"}' not in got  # ended: its label goes


def test_every_exported_name_is_documented() -> None:
    doc = (ROOT / "docs" / "metrics.md").read_text()
    tables = (LEARNER_SCALARS, LEARNER_LABELLED, NODE_SCALARS, SERVE_SCALARS, SERVE_LABELLED)
    names = [n for table in tables for _, n, *_ in table]
    assert not [n for n in names if f"`{n}`" not in doc]


def test_parse_listen() -> None:
    assert parse_listen("9100") == ("127.0.0.1", 9100) and parse_listen("0.0.0.0:9") == ("0.0.0.0", 9)
    for bad in ("x", "1:2:x", "70000"):
        with pytest.raises(ValueError):
            parse_listen(bad)


def _rows(n: int, scale: float) -> list[dict]:
    return [
        {
            "step": i,
            "reward_mean": scale * i / n,
            "eval_reward": scale * i / n if i % 5 == 0 else None,
            "staleness_max": i % 3,
            "staleness_mean": 0.5,
            "busy_fraction": 0.7,
            "rollouts_per_s": 3.0,
            "available_rollouts_per_s": 4.0,
            "cost_total": 0.01 * i,
            "broadcast_version": i - i % 2,
            "broadcast_kind": "full" if i % 10 == 0 else "delta",
            "broadcast_seconds": 0.1 * (i % 4),
        }
        for i in range(1, n + 1)
    ]


def test_plot_writes_a_png_of_several_runs(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    paths = []
    for name, scale in (("a", 1.0), ("b", 0.5)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(
            "".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n" for r in _rows(30, scale))
            + '{"torn'
        )
        paths.append(str(path))
    out = tmp_path / "fig" / "runs.png"
    res = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "plot", *paths, "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert str(out) in res.stdout
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    res = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "plot", str(empty), "-o", str(tmp_path / "x.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "no metrics rows" in res.stderr


def test_tensorboard_sink_logs_the_row(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from echorl.common.metrics_sinks import TensorBoardSink

    sink = TensorBoardSink(str(tmp_path))
    for step in (1, 2):
        sink.write(
            {"step": step, "reward_mean": 0.5 * step, "broadcast_kind": "full", "per_node_groups": {"abc": step}}
        )
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.value for e in acc.Scalars("reward_mean")] == [0.5, 1.0]
    assert [e.step for e in acc.Scalars("per_node_groups/abc")] == [1, 2]


def test_tensorboard_flag_without_the_extra_is_a_hint_not_a_traceback(tmp_path) -> None:
    blocker = tmp_path / "block" / "tensorboard"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path / "block")}
    res = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "learner", "--tensorboard", str(tmp_path / "tb")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 2 and "pip install 'echorl[track]'" in res.stderr and "Traceback" not in res.stderr


def test_demo_summary_writes_the_plot(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    import argparse

    from echorl.cli.demo import _summary

    metrics = tmp_path / "demo-metrics.jsonl"
    rows = [
        {
            **r,
            "nodes_active": 1,
            "signatures_verified": 3,
            "leases_expired": 0,
            "required_rollouts_per_s": None,
            "per_node_groups": {"abcdefgh": 5},
            "eval_reward": r["eval_reward"] or 0.1,
        }
        for r in _rows(10, 1.0)
    ]
    rows[-1]["available_rollouts_per_s"] = 2.0
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpt = tmp_path / "ckpt"
    assert _summary(metrics, 0, False, 12.0, argparse.Namespace(nodes=1, steps=10, staleness=2), ckpt) == 0
    out = capsys.readouterr().out
    assert f"plot: {metrics.with_suffix('.png')}" in out and metrics.with_suffix(".png").stat().st_size > 10_000
    assert f"checkpoint: {ckpt} (the newest 2 are kept)" in out and "--resume --checkpoint-dir" in out
    assert "required - vs available 2.0 groups/s" in out and "rollouts/s" not in out  # one throughput unit


def test_the_plot_leads_with_eval_and_leaves_out_what_has_no_data() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from echorl.cli.plot import figure

    rows = _rows(30, 1.0)
    unpriced = [{**r, "cost_total": 0.0} for r in rows]  # the demo: no node or learner has a price
    for runs, titles in (({"a": rows}, 6), ({"a": unpriced}, 5)):
        fig = figure(runs)
        axes = fig.axes
        assert len(axes) == titles and not any(ax.get_title() == "" for ax in axes)  # no empty frame
        assert axes[0].get_title().startswith("eval reward")
        eval_line, train_line = axes[0].get_lines()
        assert eval_line.get_label() == "a eval" and eval_line.get_zorder() > train_line.get_zorder()
        assert eval_line.get_linewidth() > train_line.get_linewidth()  # drawn over, not under, the train reward
        assert ("cost" in [ax.get_title() for ax in axes]) == (titles == 6)
        plt.close(fig)
