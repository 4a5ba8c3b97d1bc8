"""Multi-turn environments: Kuhn poker against the game's known values, number guessing, the
referee's endings (done, turn limit, environment error), and user environments by module:Class."""

from __future__ import annotations

import random
import sys
import types

import pytest
from kuhn import TablePolicy

from echorl.tasks import Environment, EnvStep, EnvTask, TaskError, is_episodic, load_task
from echorl.tasks.env import EpisodeRun, episode_seed
from echorl.tasks.guess import GuessNumber, random_success
from echorl.tasks.poker import (
    TABLE_KEYS,
    KuhnPoker,
    best_response_value,
    exact_value,
    exploitability,
    fixed_opponent,
    nash_p1,
    nash_p2,
    seat_value,
    strategy_of,
    uniform_policy,
)


@pytest.mark.parametrize("alpha", [0.0, 1 / 12, 1 / 6, 1 / 3])
def test_kuhn_equilibrium_is_worth_minus_one_eighteenth_to_player_one(alpha):
    assert exact_value(nash_p1(alpha), nash_p2) == pytest.approx(-1 / 18, abs=1e-12)


def test_no_pure_strategy_beats_the_equilibrium():
    nash = KuhnPoker(opponent="nash").opponent
    assert best_response_value(nash, 1) == pytest.approx(-1 / 18, abs=1e-9)
    assert best_response_value(nash, 2) == pytest.approx(1 / 18, abs=1e-9)


def test_fixed_opponent_is_exploitable_and_random_play_loses():
    for seat in (1, 2):
        assert best_response_value(fixed_opponent, seat) == pytest.approx(1 / 6, abs=1e-9)
    assert seat_value(uniform_policy, fixed_opponent, 1) == pytest.approx(-0.375)
    assert seat_value(uniform_policy, fixed_opponent, 2) == pytest.approx(-5 / 12)


@pytest.mark.parametrize("alpha", [0.0, 1 / 6, 1 / 3])
def test_the_equilibrium_is_unexploitable_and_other_play_is_not(alpha):
    assert exploitability(strategy_of(nash_p1(alpha)), strategy_of(nash_p2)) == pytest.approx(0.0, abs=1e-12)
    # the fixed opponent in both seats: a best response earns 1/6 against it in either seat
    assert exploitability(strategy_of(fixed_opponent), strategy_of(fixed_opponent)) == pytest.approx(1 / 6)
    # a policy that never answers 0/1 forfeits its ante at its first turn in either seat
    forfeit = lambda c, h: (0.0, 0.0)
    assert exploitability(forfeit, forfeit) == pytest.approx(1.0)


def _play(env: KuhnPoker, seed: int, policy) -> float:
    card = "JQK".index(env.reset(seed)[0])
    while True:
        history = env.history
        action = "1" if random.Random(seed * 7 + len(history)).random() < policy(card, history) else "0"
        step = env.step(action)
        if step.done:
            return step.reward


def test_poker_env_matches_the_exact_value_when_both_play_the_equilibrium():
    """Monte Carlo through the text environment: the agent in seat 1 plays the equilibrium
    against the equilibrium opponent, so its mean chips approach −1/18."""
    env = KuhnPoker(opponent="nash", seat=1)
    n = 30_000
    mean = sum(_play(env, s, nash_p1(1 / 6)) for s in range(n)) / n
    assert mean == pytest.approx(-1 / 18, abs=0.03)  # std of one hand < 1.6: 4 standard errors


def test_poker_text_format_and_forfeit():
    env = KuhnPoker(seat=1)
    obs = env.reset(3)
    assert obs[0] in "JQK" and obs[1:] == "1:="
    assert env.step("x") == EnvStep(done=True, reward=-1.0)  # not 0/1: forfeits the ante
    env2 = KuhnPoker(seat=2)
    obs = env2.reset(3)
    assert obs[1:3] == "2:" and obs[3] in "01" and obs.endswith("=")
    with pytest.raises(TaskError):
        KuhnPoker(opponent="shark")


def test_poker_forfeit_penalty_costs_in_training_only():
    """A forfeit with the jack loses what folding it loses; the penalty makes it strictly worse in
    the training reward, while exact evaluation still counts chips."""
    plain, charged = KuhnPoker(seat=1), KuhnPoker(seat=1, forfeit_penalty=0.25)
    plain.reset(3), charged.reset(3)
    assert plain.step("x").reward == -1.0 and charged.step("x").reward == -1.25
    assert charged.reset(3) == plain.reset(3) and charged.step("0") == plain.step("0")  # legal play unchanged
    never_answers = TablePolicy({k: 0.0 for k in TABLE_KEYS}, forfeit=1.0)
    assert charged.exact_eval(never_answers) == plain.exact_eval(never_answers) == pytest.approx(-1.0)
    task = load_task("poker", forfeit_penalty="0.5")  # as --task-option forfeit_penalty=0.5 passes it
    assert task.make_env().forfeit_penalty == 0.5
    for bad in (-0.1, 2.5, float("nan")):
        with pytest.raises(TaskError, match="forfeit_penalty"):
            KuhnPoker(forfeit_penalty=bad)


def test_poker_all_observations_fit_the_char_alphabet():
    from echorl.actor.model import build_char_tokenizer

    tok = build_char_tokenizer()
    unk = tok.unk_token_id
    task = load_task("poker")
    for p in task.next_prompts(50):
        assert unk not in tok(p.text, add_special_tokens=False)["input_ids"]


def test_guess_rewards_binary_search_and_counts_turns():
    task = load_task("guess")
    assert is_episodic(task) and task.max_turns == 4 and task.max_new_tokens == 1
    secret = GuessNumber()
    seed = next(s for s in range(100) if (secret.reset(s), secret.secret)[1] == 7)
    run = task.run(seed)
    assert run.observation == "G:="
    assert run.act("5") == ">=" and run.act("8") == "<=" and run.act("q") == "!="
    assert run.act("7") is None and run.finish == "done" and run.reward == 1.0
    assert random_success() == pytest.approx(1 - 0.9**4)


def test_turn_limit_ends_the_episode_with_the_reward_so_far():
    task = load_task("guess", max_turns=2)
    seed = next(s for s in range(100) if random.Random(s).randrange(10) == 9)
    run = task.run(seed)
    assert run.act("0") == ">="
    assert run.act("1") is None and run.over and run.finish == "turn_limit" and run.reward == 0.0


class _Flaky(Environment):
    name = "flaky"
    max_turns = 5
    max_action_tokens = 2

    def __init__(self, fail_at: int = 2) -> None:
        self.fail_at, self.t = fail_at, 0

    def reset(self, seed: int) -> str:
        if self.fail_at == 0:
            raise RuntimeError("no deck")
        return f"s{seed % 10}:"

    def step(self, action: str) -> EnvStep:
        self.t += 1
        if self.t == self.fail_at:
            raise KeyError("boom")
        return EnvStep(done=False, reward=0.5, observation="ok:")


@pytest.fixture
def user_module(monkeypatch):
    mod = types.ModuleType("my_envs")
    mod.Flaky = _Flaky
    monkeypatch.setitem(sys.modules, "my_envs", mod)
    return mod


def test_a_user_environment_loads_by_module_class_and_its_errors_end_only_the_episode(user_module, caplog):
    task = load_task("my_envs:Flaky", fail_at=2, seed=3)
    assert isinstance(task, EnvTask) and task.max_turns == 5 and task.max_new_tokens == 2
    p = task.next_prompts(1)[0]
    assert p.text.startswith("s") and p.meta["env_seed"] == episode_seed(3, 0)
    run = task.run(p.meta["env_seed"])
    assert run.act("a") == "ok:"
    with caplog.at_level("WARNING"):
        assert run.act("b") is None
    assert run.finish == "env_error" and run.reward == 0.0 and "KeyError" in run.error
    assert "environment error" in caplog.text
    broken = load_task("my_envs:Flaky", fail_at=0).run(1)  # reset raising: over before any turn
    assert broken.over and broken.finish == "env_error" and broken.act("x") is None
    with pytest.raises(TaskError):
        load_task("my_envs:Flaky", colour="red")  # unknown option: a clear error at load time


def test_bad_step_results_are_environment_errors():
    class Bad(_Flaky):
        def step(self, action: str):  # type: ignore[override]
            return EnvStep(done=False, reward=float("nan"), observation="x")

    run = EpisodeRun(Bad, 1, 3)
    assert run.act("a") is None and run.finish == "env_error" and "non-finite" in run.error


def test_eval_seeds_are_fixed_and_differ_from_training():
    task = load_task("poker", n_eval=50)
    ev = [p.meta["env_seed"] for p in task.eval_prompts()]
    assert ev == [p.meta["env_seed"] for p in load_task("poker", n_eval=50, seed=9).eval_prompts()]
    assert not set(ev) & {p.meta["env_seed"] for p in task.next_prompts(500)}


def test_a_table_opponent_plays_its_table_and_a_bad_table_is_refused():
    from echorl.tasks.poker import FIXED, TABLE_KEYS, table_text

    fixed_as_table = KuhnPoker(opponent=table_text([FIXED[k] for k in TABLE_KEYS])).opponent
    for seat in (1, 2):
        assert seat_value(uniform_policy, fixed_as_table, seat) == seat_value(uniform_policy, fixed_opponent, seat)
    for bad in ("table:0.5", "table:" + ",".join(["0.5"] * 11 + ["1.5"]), "table:" + ",".join(["x"] * 12)):
        with pytest.raises(TaskError, match="table opponent"):
            KuhnPoker(opponent=bad)
