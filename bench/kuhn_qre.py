"""Where a fixed entropy bonus leads Kuhn-poker self-play: the equilibrium of the regularised game
(an agent quantal-response equilibrium) for each bonus weight τ, and its exploitability.

Policy-gradient self-play with ``--entropy-coef τ --entropy-over actions`` maximises, at each of
the 12 decisions it reaches, the expected chips of the decision plus τ × the entropy of its
bet/pass choice (both weighted by how often the decision is reached, so the weights cancel): its
fixed point is the table where each bet probability is ``σ((Q_bet − Q_pass) / τ)``, ``Q`` the
chips each answer is worth at that decision given both seats' play. This finds it by damped
fixed-point iteration from the uniform table and prints ``τ``, the exploitability (chips/hand,
``tasks/poker.py``), the residual (how far from a fixed point the iteration ended; only rows with
a small residual are equilibria) and the table.

    python bench/kuhn_qre.py --tau 1 0.5 0.2 0.1
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from echorl.tasks.poker import DEALS, TABLE_KEYS, TERMINAL, exploitability, payoff_p1, to_act

Table = dict[tuple[int, str], float]


def value_p1(table: Table) -> float:
    """Seat 1's expected chips when both seats play ``table``."""

    def walk(cards: tuple[int, int], h: str) -> float:
        if h in TERMINAL:
            return payoff_p1(cards, h)
        p = table[(cards[to_act(h) - 1], h)]
        return p * walk(cards, h + "1") + (1 - p) * walk(cards, h + "0")

    return sum(walk(d, "") for d in DEALS) / len(DEALS)


def reach(table: Table, key: tuple[int, str]) -> float:
    """Probability that the decision ``key`` is reached (chance and both seats' earlier play)."""
    card, h = key
    total = 0.0
    for d in DEALS:
        if d[to_act(h) - 1] != card:
            continue
        p = 1.0
        for i, a in enumerate(h):
            bet = table[(d[to_act(h[:i]) - 1], h[:i])]
            p *= bet if a == "1" else 1 - bet
        total += p / len(DEALS)
    return total


def logit_response(table: Table, tau: float) -> Table:
    out = {}
    for key in TABLE_KEYS:
        sign = 1 if to_act(key[1]) == 1 else -1
        gap = sign * (value_p1({**table, key: 1.0}) - value_p1({**table, key: 0.0})) / max(reach(table, key), 1e-12)
        out[key] = 1 / (1 + math.exp(-max(-50.0, min(50.0, gap / tau))))
    return out


def equilibrium(tau: float, iters: int, damping: float) -> tuple[Table, float]:
    table = dict.fromkeys(TABLE_KEYS, 0.5)
    for _ in range(iters):
        new = logit_response(table, tau)
        table = {k: (1 - damping) * table[k] + damping * new[k] for k in TABLE_KEYS}
    residual = max(abs(table[k] - v) for k, v in logit_response(table, tau).items())
    return table, residual


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tau", type=float, nargs="+", default=[1.0, 0.5, 0.2, 0.1])
    p.add_argument("--iters", type=int, default=4000)
    p.add_argument("--damping", type=float, default=0.03)
    args = p.parse_args()
    print(
        "| τ | exploitability | residual | bet probabilities (seat 1: J, J·01, Q, Q·01, K, K·01; seat 2: J·0, J·1, …) |"
    )
    print("|---|---|---|---|")
    for tau in args.tau:
        table, residual = equilibrium(tau, args.iters, args.damping)
        play = lambda c, h, t=table: (1 - t[(c, h)], t[(c, h)])
        probs = " ".join(f"{table[k]:.2f}" for k in TABLE_KEYS)
        print(f"| {tau:g} | {exploitability(play, play):.3f} | {residual:.1e} | {probs} |")


if __name__ == "__main__":
    main()
