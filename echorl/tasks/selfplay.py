"""Self-play for two-player environments: the training opponent is the policy itself.

An environment that supports it (Kuhn poker, ``tasks/poker.py``) provides two functions:
``opponent_table(policy)``, the policy's play at every decision as a list of probabilities, and
``opponent_options(table)``, the environment options under which the opponent plays ``table``.
:class:`SelfPlay` keeps the last ``k`` tables and makes their mean the opponent of the training
episodes (``k = 1``: the last iterate; a larger ``k`` approaches fictitious play, whose average
opponent damps the cycling of best responses to best responses).

The opponent must be part of what the learner replays: each training prompt carries the options
it was made under (``prompt.meta["env_options"]``, and the lease's ``EpisodeSpec.options``), so an
episode leased before an update is run and replayed against the opponent it was dealt, never the
current one. The tables are refreshed at each evaluation (``rl/loop.py``): the snapshot is read in
the evaluation's worker thread, adopted on the event loop between steps. Where the environment
can score a table (``table_exploitability``), the evaluation row also gets the opponent's own
``opponent_exploitability``: with a large ``k`` that is fictitious play's average strategy, which
is what fictitious play makes converge (the policy's own figure stays ``exploitability``).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from .base import TaskError, TurnPolicy

MAX_SNAPSHOTS = 1000  # bound on ``k`` (the history is k tables of a few dozen floats)


class SelfPlayEnvironment(Protocol):
    def opponent_table(self, policy: TurnPolicy) -> list[float]: ...

    def opponent_options(self, table: list[float]) -> dict[str, Any]: ...


class SelfPlay:
    """The opponent history of one run (a checkpointed part of the training loop)."""

    def __init__(self, env: SelfPlayEnvironment, snapshots: int) -> None:
        if not hasattr(env, "opponent_table") or not hasattr(env, "opponent_options"):
            raise TaskError(f"{type(env).__name__} has no self-play (opponent_table / opponent_options)")
        if not 1 <= int(snapshots) <= MAX_SNAPSHOTS:
            raise TaskError(f"self_play must be 0 (off) or 1..{MAX_SNAPSHOTS} snapshots, got {snapshots!r}")
        self.env, self.snapshots = env, int(snapshots)
        self.tables: list[list[float]] = []
        self.mean: list[float] = []  # the opponent's table (the mean of ``tables``)
        self.options: dict[str, Any] = {}  # the training episodes' option overrides (empty: the base opponent)

    def snapshot(self, policy: TurnPolicy) -> list[float]:
        """The policy's table (pure: runs in the evaluation's worker thread)."""
        return [float(p) for p in self.env.opponent_table(policy)]

    def adopt(self, table: list[float]) -> None:
        """Make the mean of the last ``snapshots`` tables the opponent of new training prompts."""
        self.tables = [*self.tables, table][-self.snapshots :]
        self.mean = [math.fsum(col) / len(self.tables) for col in zip(*self.tables)]
        self.options = dict(self.env.opponent_options(self.mean))  # one assignment: prompts see old or new

    def metrics(self) -> dict[str, float | int]:
        """The evaluation row's self-play figures: how many snapshots the opponent averages, and
        (where the environment scores tables) that opponent's exploitability."""
        score = getattr(self.env, "table_exploitability", None)
        out: dict[str, float | int] = {"self_play_snapshots": len(self.tables)}
        if score is not None and self.mean:
            out["opponent_exploitability"] = float(score(self.mean))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"tables": [list(t) for t in self.tables]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tables = [[float(p) for p in t] for t in state.get("tables", [])][-self.snapshots :]
        if tables:
            self.tables = tables[:-1]
            self.adopt(tables[-1])
