"""``echorl plot``: one PNG from one or more metrics files (learner ``--metrics-out`` or
``train-local``), one line per run on each panel: eval and training reward, staleness, learner
busy fraction, rollout throughput, broadcast seconds by kind, cost. Needs matplotlib (the
``plot`` extra); without it the command prints a one-line hint and exits 2."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# (title, [(row key, label suffix)], y label)
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...], str], ...] = (
    ("reward", (("eval_reward", "eval"), ("reward_mean", "train")), "mean reward"),
    ("staleness", (("staleness_max", "max"), ("staleness_mean", "mean")), "t - b (versions)"),
    ("learner busy fraction", (("busy_fraction", ""), ("learner_busy_frac", "")), "fraction"),
    ("rollout throughput", (("rollouts_per_s", "trained"), ("available_rollouts_per_s", "available")), "groups/s"),
    ("cost", (("cost_total", "total"), ("cost_rollouts_on_learner_estimate", "learner-only est.")), "cost"),
)


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


def plot(runs: dict[str, list[dict[str, Any]]], out: str | Path, title: str = "") -> Path:
    """Draw the panels for every run and save a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    flat = list(axes.flat)
    for ax, (name, keys, ylabel) in zip(flat, PANELS):
        for run, rows in runs.items():
            for key, suffix in keys:
                xs, ys = _series(rows, key)
                if xs:
                    ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=f"{run} {suffix}".strip())
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
    ax = flat[len(PANELS)]
    for run, rows in runs.items():
        for kind, (xs, ys) in _broadcasts(rows).items():
            ax.plot(xs, ys, "o" if kind == "full" else ".", label=f"{run} {kind}")
    ax.set_title("broadcast seconds")
    ax.set_xlabel("version")
    ax.set_ylabel("seconds")
    for ax in flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
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
