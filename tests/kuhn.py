"""A Kuhn poker strategy as a model would play it: the TurnPolicy the exact evaluation, the
exploitability and self-play read (tests/rl/test_exact_eval.py, tests/tasks/test_selfplay.py)."""

from __future__ import annotations

from echorl.tasks.base import Query
from echorl.tasks.poker import CARDS


class TablePolicy:
    """A Kuhn strategy as a TurnPolicy: P(bet) per (card, history) read back from the transcript."""

    def __init__(self, table: dict[tuple[int, str], float], forfeit: float = 0.0) -> None:
        self.table, self.forfeit = table, forfeit

    def probs(self, queries: list[Query]) -> list[float]:
        out = []
        for q in queries:
            view = q.turns[0]
            history = view[3:-1] + "".join(t.rstrip("=") for t in q.turns[1:])
            p_bet = self.table[(CARDS.index(view[0]), history)] * (1 - self.forfeit)
            out.append(p_bet if q.text == "1" else (1 - self.forfeit) - p_bet)
        return out
