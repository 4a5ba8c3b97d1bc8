"""Echo-2's staleness result on our task: ``train-local`` for each staleness bound S and seed,
with and without the off-policy correction (clipped ratio + truncated IS against the behaviour
policy; ``--no-off-policy-correction`` takes the ratio against the current policy instead).

    nice -n 5 python bench/staleness_sweep.py --json                       # the full sweep
    python bench/staleness_sweep.py --staleness 0 4 --seeds 0 --steps 40   # a quick look
    python bench/staleness_sweep.py --report runs/sweep/*.jsonl --plot docs/staleness-sweep.png

Every run uses the same steps, data (prompt order from ``--seed``) and start model; it reports
the final held-out ``eval_reward`` (mean, min, max over seeds), optimizer steps per second and
the learner busy fraction (``busy_fraction``: time in ``train_step`` + publishing over the
wall time since the first rollout, held-out evaluation excluded). One JSON line per
(S, correction), each with the S = 0 run of the same correction as its baseline (measured in the
same invocation; S = 0 is always run). ``--metrics-dir`` keeps every run's metrics JSONL (for the
plot in docs/learning-notes.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import emit

STALENESS = [0, 1, 2, 4, 6, 8, 11, 16]


def run_one(s: int, seed: int, correction: bool, args: argparse.Namespace, out: Path) -> dict:
    """One ``train-local`` run in a fresh process; its last metrics row and CPU seconds."""
    cmd = [
        sys.executable,
        "-m",
        "echorl.cli",
        "train-local",
        "--staleness",
        str(s),
        "--seed",
        str(seed),
        "--steps",
        str(args.steps),
        "--actors",
        str(args.actors),
        "--eval-every",
        str(args.steps),
        "--metrics-out",
        str(out),
        "--quiet",
        "--checkpoint-dir",
        "none",  # the figure is the metrics row; train-local keeps a checkpoint by default
        *args.extra,
    ]
    if not correction:
        cmd.append("--no-off-policy-correction")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    t0, r0 = time.perf_counter(), os.times()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    r1 = os.times()
    if proc.returncode != 0:
        raise RuntimeError(f"train-local S={s} seed={seed} correction={correction} failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    last = rows[-1]
    return {
        "eval_first": rows[0]["eval_reward"],
        "eval_final": last["eval_reward"],
        "steps_per_s": last["step"] / max(1e-9, last["elapsed_s"]),
        "busy": last["busy_fraction"],
        "wall_s": time.perf_counter() - t0,
        "cpu_s": (r1.children_user + r1.children_system) - (r0.children_user + r0.children_system),
    }


def summarise(runs: list[dict]) -> dict:
    finals = [r["eval_final"] for r in runs]
    return {
        "eval_final_mean": round(mean(finals), 4),
        "eval_final_min": round(min(finals), 4),
        "eval_final_max": round(max(finals), 4),
        "eval_first_mean": round(mean(r["eval_first"] for r in runs), 4),
        "steps_per_s": round(mean(r["steps_per_s"] for r in runs), 3),
        "busy_fraction": round(mean(r["busy"] for r in runs), 3),
        "wall_s": round(sum(r["wall_s"] for r in runs), 1),
        "cpu_s": round(sum(r["cpu_s"] for r in runs), 1),
    }


def report(paths: list[str], png: str | None) -> None:
    """The markdown table (and, with ``png``, the plot) of sweep JSON lines read back from files."""
    rows = [
        json.loads(line)
        for p in paths
        for line in Path(p).read_text().splitlines()
        if line.startswith('{"bench": "staleness_sweep"')
    ]
    rows.sort(key=lambda r: (not r["off_policy_correction"], r["staleness"]))
    print("| S | correction | eval_final mean (min–max) | vs S=0 | steps/s | busy_fraction |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['staleness']} | {'on' if r['off_policy_correction'] else 'off'} | "
            f"{r['eval_final_mean']:.3f} ({r['eval_final_min']:.3f}–{r['eval_final_max']:.3f}) | "
            f"{r['eval_final_vs_S0']:+.3f} | {r['steps_per_s']:.2f} | {r['busy_fraction']:.2f} |"
        )
    if png is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for corr, label in [(True, "clipped ratio + truncated IS"), (False, "no off-policy correction")]:
        sel = [r for r in rows if r["off_policy_correction"] == corr]
        if not sel:
            continue
        xs = [r["staleness"] for r in sel]
        mid = [r["eval_final_mean"] for r in sel]
        err = [[m - r["eval_final_min"] for m, r in zip(mid, sel)], [r["eval_final_max"] - m for m, r in zip(mid, sel)]]
        ax.errorbar(xs, mid, yerr=err, marker="o", capsize=3, label=label)
    if rows:
        ax.axhline(rows[0]["eval_first_mean"], color="grey", ls=":", label="start (step 0)")
        ax.set_title(
            f"final eval_reward vs staleness bound S ({rows[0]['steps']} steps, "
            f"{len(rows[0]['seeds'])} seeds, min–max bars)",
            fontsize=9,
        )
    ax.set_xlabel("staleness bound S")
    ax.set_ylabel("held-out eval_reward")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--staleness", type=int, nargs="+", default=STALENESS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=120, help="optimizer steps per run (same for every run)")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--correction", choices=["both", "on", "off"], default="both")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run before it counts as failed")
    p.add_argument("--metrics-dir", default=None, help="keep each run's metrics JSONL here")
    p.add_argument("--json", action="store_true", help="one JSON line per (S, correction)")
    p.add_argument("--report", nargs="+", metavar="JSONL", help="print the markdown table of earlier --json output")
    p.add_argument("--plot", metavar="PNG", help="with --report: also draw final eval vs S")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more train-local flags")
    args = p.parse_args()
    args.extra = [a for a in args.extra if a != "--"]
    if args.report:
        report(args.report, args.plot)
        return
    if args.steps < 1 or not args.seeds or any(s < 0 for s in args.staleness):
        p.error("need --steps >= 1, at least one seed and S >= 0")
    grid = sorted(set(args.staleness) | {0})
    corrections = {"both": [True, False], "on": [True], "off": [False]}[args.correction]
    keep = Path(args.metrics_dir) if args.metrics_dir else None
    if keep:
        keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="echorl-sweep-") as tmp:
        for correction in corrections:
            base = None
            for s in grid:
                runs = []
                for seed in args.seeds:
                    name = f"S{s}-seed{seed}-{'corr' if correction else 'nocorr'}.jsonl"
                    runs.append(run_one(s, seed, correction, args, (keep or Path(tmp)) / name))
                res = summarise(runs)
                if s == 0:
                    base = res
                emit(
                    {
                        "bench": "staleness_sweep",
                        "staleness": s,
                        "off_policy_correction": correction,
                        "steps": args.steps,
                        "seeds": args.seeds,
                        **res,
                        "baseline_S0_eval_final_mean": base["eval_final_mean"],
                        "baseline_S0_steps_per_s": base["steps_per_s"],
                        "eval_final_vs_S0": round(res["eval_final_mean"] - base["eval_final_mean"], 4),
                        "speedup_vs_S0": round(res["steps_per_s"] / max(1e-9, base["steps_per_s"]), 3),
                    },
                    args.json,
                )
                sys.stdout.flush()


if __name__ == "__main__":
    main()
