"""Kuhn poker (``"poker"``): a heads-up hand against a fixed opponent policy, written from the rules.

Rules (Kuhn 1950): a deck of three cards J < Q < K; each player antes 1 chip and gets one card.
Player 1 acts first. An action is pass (``0``: check, or fold when facing a bet) or bet (``1``:
bet 1 chip, or call a bet). Histories end at ``00`` (showdown for 1), ``11`` and ``011``
(showdown for 2), ``10`` (player 2 folds) and ``010`` (player 1 folds). With both players at a
Nash equilibrium the game is worth −1/18 chip per hand to player 1 (:func:`exact_value`; the
tests check it for the whole equilibrium family).

Text the default character-level model can read and answer: the prompt is
``<card><seat>:<history>=`` (``K1:=``: holding the king, first to act; ``Q2:1=``: holding the
queen, second, the opponent bet); the model answers one character, ``0`` or ``1``; when the
hand goes on the observation is the opponent's reply followed by ``=`` (``1=``). Anything else
than ``0``/``1`` (EOS included) forfeits the hand: the agent loses what it has put in, and in
training ``forfeit_penalty`` chips more (default 0). A forfeit with the jack otherwise loses exactly
what folding or checking it down loses, so nothing in the reward keeps self-play from drifting
onto answers outside ``0``/``1``; the penalty makes the legal pass strictly better. Exact
evaluations (``exact_eval``, ``exploitability``) count chips only, without it.

The reward is the agent's chips won in the hand (−2 … +2); ``eval_reward`` is therefore mean
chips per hand over the held-out deals. The seat alternates with the seed (``seat=1``/``2``
fixes it). Opponents: ``"fixed"`` (default: a loose, exploitable player: see ``FIXED``),
``"nash"`` (the equilibrium with α = 1/6: nothing to exploit) or ``"table:p1,…,p12"``, a player
that bets with probability ``p_i`` at the i-th decision of ``TABLE_KEYS`` — how self-play
(``tasks/selfplay.py``, ``--task-option self_play=K``) makes the policy its own opponent.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

from .base import EnvStep, Query, TaskError, TurnPolicy
from .env import Environment

CARDS = "JQK"
TERMINAL = ("00", "11", "011", "10", "010")
#: probability of ``1`` (bet/call) by (card, history before the decision)
Policy = Callable[[int, str], float]

#: A loose opponent: bets and calls with the queen as if it were the king, bluffs the jack half
#: the time, and never folds the queen. Betting the king and checking/folding the jack beats it.
FIXED: dict[tuple[int, str], float] = {
    (0, ""): 0.5,
    (1, ""): 1.0,
    (2, ""): 1.0,  # first to act
    (0, "0"): 0.5,
    (1, "0"): 1.0,
    (2, "0"): 1.0,  # second, after a check
    (0, "1"): 0.0,
    (1, "1"): 1.0,
    (2, "1"): 1.0,  # second, facing a bet
    (0, "01"): 0.0,
    (1, "01"): 1.0,
    (2, "01"): 1.0,  # first, facing a bet after checking
}


def nash_p1(alpha: float) -> Policy:
    """Player 1's equilibrium strategies (α ∈ [0, 1/3])."""
    table = {(0, ""): alpha, (1, ""): 0.0, (2, ""): 3 * alpha, (0, "01"): 0.0, (1, "01"): alpha + 1 / 3, (2, "01"): 1.0}
    return lambda card, h: table[(card, h)]


def nash_p2(card: int, history: str) -> float:
    """Player 2's equilibrium strategy."""
    return {(0, "0"): 1 / 3, (1, "0"): 0.0, (2, "0"): 1.0, (0, "1"): 0.0, (1, "1"): 1 / 3, (2, "1"): 1.0}[
        (card, history)
    ]


def fixed_opponent(card: int, history: str) -> float:
    return FIXED[(card, history)]


OPPONENTS: dict[str, Policy] = {
    "fixed": fixed_opponent,
    "nash": lambda c, h: nash_p1(1 / 6)(c, h) if len(h) % 2 == 0 else nash_p2(c, h),
}


TABLE_PREFIX = "table:"
#: A forfeit's extra training cost is at most the largest stake: enough to make passing strictly
#: better, never so much that a forfeit outweighs every hand the agent can play.
MAX_FORFEIT_PENALTY = 2.0


def table_policy(text: str) -> Policy:
    """The opponent of a ``table:p1,…,p12`` option (bet probabilities at ``TABLE_KEYS``)."""
    parts = text[len(TABLE_PREFIX) :].split(",")
    try:
        probs = [float(x) for x in parts]
    except ValueError:
        probs = []
    if len(probs) != len(TABLE_KEYS) or not all(0.0 <= x <= 1.0 for x in probs):
        raise TaskError(f"poker: a table opponent is {len(TABLE_KEYS)} probabilities in [0, 1], got {text[:120]!r}")
    table = dict(zip(TABLE_KEYS, probs))
    return lambda card, h: table[(card, h)]


def table_text(table: list[float]) -> str:
    """The option text of a table (4 decimals: what both ends parse is this text)."""
    return TABLE_PREFIX + ",".join(f"{min(1.0, max(0.0, x)):.4f}" for x in table)


def to_act(history: str) -> int:
    """Seat (1 or 2) whose decision it is."""
    return 1 + len(history) % 2


def payoff_p1(cards: tuple[int, int], history: str) -> int:
    """Chips won by player 1 at a terminal history."""
    if history == "10":
        return 1
    if history == "010":
        return -1
    stake = 1 if history == "00" else 2
    return stake if cards[0] > cards[1] else -stake


#: A seat's play with forfeits: (card, history) → (P(pass), P(bet)); the rest of the mass is an
#: answer other than ``0``/``1``, which forfeits what the seat has put in.
Strategy = Callable[[int, str], tuple[float, float]]
#: The decisions of each seat: (card, history before the decision).
INFO_SETS: dict[int, list[tuple[int, str]]] = {
    1: [(c, h) for c in range(3) for h in ("", "01")],
    2: [(c, h) for c in range(3) for h in ("0", "1")],
}
DEALS = list(itertools.permutations(range(3), 2))
#: a table opponent's decisions, in order: seat 1's, then seat 2's
TABLE_KEYS = INFO_SETS[1] + INFO_SETS[2]


def strategy_of(policy: Policy) -> Strategy:
    """A bet-probability policy as a strategy that never forfeits."""
    return lambda card, h: (1.0 - policy(card, h), policy(card, h))


def strategy_value(s1: Strategy, s2: Strategy) -> float:
    """Player 1's expected chips per hand (every deal, every branch, forfeits included)."""

    def walk(cards: tuple[int, int], history: str) -> float:
        if history in TERMINAL:
            return payoff_p1(cards, history)
        seat = to_act(history)
        p_pass, p_bet = (s1 if seat == 1 else s2)(cards[seat - 1], history)
        forfeit = put_in(history, seat) * (1.0 if seat == 2 else -1.0)
        value = max(0.0, 1.0 - p_pass - p_bet) * forfeit
        if p_bet > 0:
            value += p_bet * walk(cards, history + "1")
        if p_pass > 0:
            value += p_pass * walk(cards, history + "0")
        return value

    return sum(walk(d, "") for d in DEALS) / len(DEALS)


def exact_value(p1: Policy, p2: Policy) -> float:
    """Player 1's expected chips per hand (every deal, every branch; no sampling)."""
    return strategy_value(strategy_of(p1), strategy_of(p2))


def seat_value(agent: Policy, opponent: Policy, seat: int) -> float:
    """The agent's expected chips per hand in ``seat`` (1 or 2)."""
    return exact_value(agent, opponent) if seat == 1 else -exact_value(opponent, agent)


def best_response_to(opponent: Strategy, seat: int) -> float:
    """What the best deterministic strategy earns in ``seat`` against ``opponent`` in the other
    (exhaustive: a seat has 6 information sets, so 64 pure strategies; a best response never
    forfeits, as passing is never worse)."""
    best = float("-inf")
    for bits in itertools.product((0.0, 1.0), repeat=len(INFO_SETS[seat])):
        table = dict(zip(INFO_SETS[seat], bits))
        mine: Strategy = lambda c, h, t=table: (1.0 - t[(c, h)], t[(c, h)])
        value = strategy_value(mine, opponent) if seat == 1 else -strategy_value(opponent, mine)
        best = max(best, value)
    return best


def best_response_value(opponent: Policy, seat: int) -> float:
    """What the best deterministic strategy earns against ``opponent`` in ``seat``."""
    return best_response_to(strategy_of(opponent), seat)


def exploitability(s1: Strategy, s2: Strategy) -> float:
    """How far the strategy pair (``s1`` in seat 1, ``s2`` in seat 2) is from a Nash equilibrium:
    the mean of what a best response earns against each seat, over the game's value (seat 1's
    best response against ``s2`` earns −1/18 at equilibrium, seat 2's against ``s1`` +1/18), so 0
    exactly at an equilibrium and positive otherwise, in chips per hand."""
    return (best_response_to(s2, 1) + best_response_to(s1, 2)) / 2


def put_in(history: str, seat: int) -> int:
    """Chips ``seat`` has put in so far: the ante and each of its bets (what a forfeit loses)."""
    return 1 + sum(1 for i, a in enumerate(history) if a == "1" and to_act(history[:i]) == seat)


def uniform_policy(card: int, history: str) -> float:
    return 0.5


class KuhnPoker(Environment):
    """One hand of Kuhn poker against ``opponent`` (see the module docstring)."""

    name = "poker"
    max_turns = 2
    max_action_tokens = 1
    stop: list[str] = []
    legal_actions = ["0", "1"]  # (anything else forfeits)
    n_eval = 1200

    def __init__(self, opponent: str = "fixed", seat: int = 0, forfeit_penalty: float = 0.0) -> None:
        if isinstance(opponent, str) and opponent.startswith(TABLE_PREFIX):
            self.opponent = table_policy(opponent)
        elif opponent in OPPONENTS:
            self.opponent = OPPONENTS[opponent]
        else:
            raise TaskError(f"poker: opponent must be one of {sorted(OPPONENTS)} or {TABLE_PREFIX}…, got {opponent!r}")
        if seat not in (0, 1, 2):
            raise TaskError(f"poker: seat must be 0 (alternate), 1 or 2, got {seat!r}")
        self.seat = int(seat)
        penalty = float(forfeit_penalty)
        if not 0.0 <= penalty <= MAX_FORFEIT_PENALTY:
            raise TaskError(
                f"poker: forfeit_penalty must be in [0, {MAX_FORFEIT_PENALTY}] chips, not {forfeit_penalty!r}"
            )
        self.forfeit_penalty = penalty
        self.rng = random.Random(0)
        self.cards = (0, 1)
        self.agent = 1
        self.history = ""

    def _opponent_acts(self) -> None:
        card = self.cards[2 - self.agent]
        bet = self.rng.random() < self.opponent(card, self.history)
        self.history += "1" if bet else "0"

    def _view(self) -> str:
        return f"{CARDS[self.cards[self.agent - 1]]}{self.agent}:{self.history}="

    def reset(self, seed: int) -> str:
        self.rng = random.Random(seed)
        deal = self.rng.sample(range(3), 2)
        self.cards = (deal[0], deal[1])
        self.agent = self.seat or 1 + self.rng.randrange(2)
        self.history = ""
        if self.agent == 2:
            self._opponent_acts()
        return self._view()

    def _agent_chips(self) -> int:
        p1 = payoff_p1(self.cards, self.history)
        return p1 if self.agent == 1 else -p1

    def step(self, action: str) -> EnvStep:
        if action not in ("0", "1"):
            return EnvStep(done=True, reward=-float(put_in(self.history, self.agent)) - self.forfeit_penalty)
        self.history += action
        if self.history not in TERMINAL:
            self._opponent_acts()
        if self.history in TERMINAL:
            return EnvStep(done=True, reward=float(self._agent_chips()))
        return EnvStep(done=False, reward=0.0, observation=f"{self.history[-1]}=")

    # -- exact evaluation ----------------------------------------------------------------
    def strategy(self, policy: TurnPolicy) -> dict[int, Strategy]:
        """The policy's play in each seat, read at every information set from the transcript the
        episode shows it there (one batch of 24 queries: pass and bet at 12 decisions)."""
        views: list[tuple[int, tuple[int, str], tuple[str, ...]]] = []
        for seat, sets in INFO_SETS.items():
            for card, h in sets:
                first = f"{CARDS[card]}{seat}:{h if seat == 2 else ''}="
                views.append((seat, (card, h), (first, "0", "1=") if h == "01" else (first,)))
        probs = policy.probs([Query(turns, a, False) for _, _, turns in views for a in ("0", "1")])
        tables: dict[int, dict[tuple[int, str], tuple[float, float]]] = {1: {}, 2: {}}
        for i, (seat, key, _) in enumerate(views):
            tables[seat][key] = (probs[2 * i], probs[2 * i + 1])
        return {seat: (lambda c, h, t=table: t[(c, h)]) for seat, table in tables.items()}

    def exact_eval(self, policy: TurnPolicy) -> float:
        """The agent's expected chips per hand under ``policy``: every deal, each seat this
        environment deals (both, equally likely, when it alternates), every branch of the
        opponent's and the agent's play (an answer other than ``0``/``1`` forfeits)."""
        mine, theirs = self.strategy(policy), strategy_of(self.opponent)
        values = {1: strategy_value(mine[1], theirs), 2: -strategy_value(theirs, mine[2])}
        seats = (self.seat,) if self.seat else (1, 2)
        return sum(values[seat] for seat in seats) / len(seats)

    def exact_metrics(self, policy: TurnPolicy) -> dict[str, float]:
        """Exact figures beside the reward: ``exploitability`` of the policy playing both seats
        (chips per hand a best response gains over the game's value; 0 at a Nash equilibrium) and
        ``forfeit_prob``, the mean probability of an answer other than ``0``/``1`` at its 12
        decisions (the mass an entropy bonus can push onto the rest of the vocabulary)."""
        mine = self.strategy(policy)
        forfeit = [1.0 - sum(mine[to_act(h)](card, h)) for card, h in TABLE_KEYS]
        return {"exploitability": exploitability(mine[1], mine[2]), "forfeit_prob": sum(forfeit) / len(forfeit)}

    # -- self-play (tasks/selfplay.py) -----------------------------------------------------
    def opponent_table(self, policy: TurnPolicy) -> list[float]:
        """The policy's bet probability at each decision of ``TABLE_KEYS``. An answer other than
        ``0``/``1`` facing a bet forfeits what a fold loses, so it counts as passing there;
        elsewhere it is left out (the bet probability is over the two legal answers; neither: 1/2)."""
        mine = self.strategy(policy)
        out = []
        for card, h in TABLE_KEYS:
            p_pass, p_bet = mine[to_act(h)](card, h)
            if h.endswith("1"):
                out.append(p_bet)
            else:
                out.append(p_bet / (p_pass + p_bet) if p_pass + p_bet > 1e-12 else 0.5)
        return out

    @staticmethod
    def opponent_options(table: list[float]) -> dict[str, str]:
        return {"opponent": table_text(table)}

    @staticmethod
    def table_exploitability(table: list[float]) -> float:
        """:func:`exploitability` of the player of ``table`` (bet probabilities at ``TABLE_KEYS``)
        in both seats: self-play's training opponent, the mean of the policy's last snapshots."""
        bets = dict(zip(TABLE_KEYS, table))
        play: Strategy = lambda c, h: (1.0 - bets[(c, h)], bets[(c, h)])
        return exploitability(play, play)
