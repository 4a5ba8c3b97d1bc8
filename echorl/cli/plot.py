"""``echorl plot``: one PNG from one or more metrics files (learner ``--metrics-out`` or
``train-local``), one line per run on each panel. The held-out eval reward comes first, drawn
bold over the training reward; then staleness, learner busy fraction, rollout throughput (groups/s),
cost and broadcast seconds by kind. A panel with nothing to show is left out (cost while no node
or learner has a price: every cost is 0). Needs matplotlib (the ``plot`` extra); without it the
command prints a one-line hint and exits 2."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[tuple[str, str], ...]  # (row key, label suffix); the first is drawn bold, on top
    ylabel: str
    zero_is_empty: bool = False  # all zeros mean "not measured here" (costs without prices)


PANELS: tuple[Panel, ...] = (
    Panel("eval reward (held-out), training reward", (("eval_reward", "eval"), ("reward_mean", "train")), "reward"),
    Panel("staleness", (("staleness_max", "max"), ("staleness_mean", "mean")), "t - b (versions)"),
    Panel("learner busy fraction", (("busy_fraction", ""), ("learner_busy_frac", "")), "fraction"),
    Panel("rollout throughput", (("rollouts_per_s", "trained"), ("available_rollouts_per_s", "available")), "groups/s"),
    Panel(
        "cost",
        (("cost_total", "total"), ("cost_rollouts_on_learner_estimate", "learner-only est.")),
        "cost",
        zero_is_empty=True,
    ),
)
BROADCAST_TITLE = "broadcast seconds"
COLUMNS = 3  # panels per row of the figure


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("metrics", nargs="+", help="JSONL metrics files (one line per step); several runs share the figure")
    p.add_argument("-o", "--out", required=True, help="PNG file to write")
    p.add_argument("--title", default="", help="figure title")


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics file; lines that are not JSON objects (a torn last line) are skipped."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(r.get("step"), (int, float)):
            xs.append(float(r["step"]))
            ys.append(float(v))
    return xs, ys


def _broadcasts(rows: list[dict[str, Any]]) -> dict[str, tuple[list[float], list[float]]]:
    """Per kind: (version, seconds) of each completed broadcast, once per version."""
    seen: dict[int, tuple[str, float]] = {}
    for r in rows:
        v, kind, secs = r.get("broadcast_version"), r.get("broadcast_kind"), r.get("broadcast_seconds")
        if isinstance(v, int) and isinstance(kind, str) and isinstance(secs, (int, float)):
            seen[v] = (kind, float(secs))
    out: dict[str, tuple[list[float], list[float]]] = {}
    for v, (kind, secs) in sorted(seen.items()):
        xs, ys = out.setdefault(kind, ([], []))
        xs.append(float(v))
        ys.append(secs)
    return out


def _has_data(panel: Panel, runs: dict[str, list[dict[str, Any]]]) -> bool:
    values = [v for rows in runs.values() for key, _ in panel.series for v in _series(rows, key)[1]]
    return any(v != 0 for v in values) if panel.zero_is_empty else bool(values)


def figure(runs: dict[str, list[dict[str, Any]]], title: str = "") -> Any:
    """The matplotlib figure of ``runs``: the panels that have data, eval reward first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS if _has_data(p, runs)]
    broadcasts = {run: _broadcasts(rows) for run, rows in runs.items()}
    count = len(panels) + (1 if any(broadcasts.values()) else 0)
    rows_n = max(1, math.ceil(count / COLUMNS))
    fig, axes = plt.subplots(rows_n, COLUMNS, figsize=(5 * COLUMNS, 4 * rows_n), constrained_layout=True, squeeze=False)
    flat = list(axes.flat)
    for ax, panel in zip(flat, panels):
        for run, rows in runs.items():
            for i, (key, suffix) in enumerate(panel.series):
                xs, ys = _series(rows, key)
                if not xs:
                    continue
                lead = i == 0  # eval over train, max over mean: the first series is the one to read
                ax.plot(
                    xs,
                    ys,
                    marker="o" if lead and len(xs) < 60 else None,
                    markersize=3,
                    linewidth=2.2 if lead else 0.9,
                    alpha=1.0 if lead else 0.5,
                    zorder=3 if lead else 2,
                    label=f"{run} {suffix}".strip(),
                )
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
    if any(broadcasts.values()):
        ax = flat[len(panels)]
        for run, kinds in broadcasts.items():
            for kind, (xs, ys) in kinds.items():
                ax.plot(xs, ys, "o" if kind == "full" else ".", label=f"{run} {kind}")
        ax.set_title(BROADCAST_TITLE)
        ax.set_xlabel("version")
        ax.set_ylabel("seconds")
    for ax in flat[count:]:
        ax.remove()  # no empty frame where a panel had nothing to show
    for ax in fig.axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    return fig


def plot(runs: dict[str, list[dict[str, Any]]], out: str | Path, title: str = "") -> Path:
    """Draw the panels for every run and save a PNG; returns its path."""
    fig = figure(runs, title)  # chooses the Agg backend before pyplot is imported here
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def run_names(paths: list[str]) -> list[str]:
    """Short, distinct legend names: the file stems (with the parent folder if stems repeat)."""
    stems = [Path(p).stem for p in paths]
    if len(set(stems)) == len(stems):
        return stems
    return [f"{Path(p).parent.name}/{Path(p).stem}" for p in paths]


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("echorl plot: needs the 'plot' extra: pip install 'echorl[plot]'", file=sys.stderr)
        return 2
    runs: dict[str, list[dict[str, Any]]] = {}
    for name, path in zip(run_names(args.metrics), args.metrics):
        try:
            rows = load_rows(path)
        except OSError as exc:
            print(f"echorl plot: {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        if not rows:
            print(f"echorl plot: {path}: no metrics rows", file=sys.stderr)
            return 2
        runs[name] = rows
    print(f"plot: {plot(runs, args.out, args.title)}")
    return 0
