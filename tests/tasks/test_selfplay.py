"""Self-play (tasks/selfplay.py): the policy as its own Kuhn poker opponent, each training prompt
carrying the opponent it was dealt through rollout, lease and replay, and the history
checkpointed."""

from __future__ import annotations

import os

import pytest
import torch
from kuhn import TablePolicy

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from echorl.actor.backend import TorchBackend
from echorl.actor.episodes import run_episodes
from echorl.actor.model import TinyArch, build_char_tokenizer, make_model
from echorl.actor.types import RolloutGroup, SamplingParams
from echorl.rl.replay import Replayer, ReplayMismatch, episode_spec
from echorl.tasks import TaskError, load_task
from echorl.tasks.poker import FIXED, TABLE_KEYS, KuhnPoker, nash_p1, nash_p2, seat_value, table_policy

NASH = {**{k: nash_p1(1 / 6)(*k) for k in TABLE_KEYS[:6]}, **{k: nash_p2(*k) for k in TABLE_KEYS[6:]}}
ALWAYS_BET = dict.fromkeys(TABLE_KEYS, 1.0)


def test_the_snapshot_of_a_policy_is_its_table_and_the_opponent_plays_it():
    task = load_task("poker", self_play=1)
    table = task.self_play.snapshot(TablePolicy(NASH))
    assert table == pytest.approx([NASH[k] for k in TABLE_KEYS], abs=1e-12)
    # an illegal answer facing a bet folds: it counts as passing there, and is left out elsewhere
    half = task.self_play.snapshot(TablePolicy(NASH, forfeit=0.5))
    want = [NASH[(c, h)] * (0.5 if h.endswith("1") else 1.0) for c, h in TABLE_KEYS]
    assert half == pytest.approx(want, abs=1e-12)
    task.self_play.adopt(table)
    opponent = table_policy(task.self_play.options["opponent"])
    fixed = lambda c, h: FIXED[(c, h)]
    for seat in (1, 2):  # the opponent is the equilibrium (to the table's 4 decimals)
        nash = KuhnPoker(opponent="nash").opponent
        assert seat_value(fixed, opponent, seat) == pytest.approx(seat_value(fixed, nash, seat), abs=1e-3)


def test_the_opponent_is_the_mean_of_the_last_k_snapshots_and_survives_a_checkpoint():
    task = load_task("poker", self_play=2)
    play = task.self_play
    for p in (0.0, 1.0, 0.5):  # k = 2: the first snapshot has left the mean
        play.adopt([p] * len(TABLE_KEYS))
    assert play.options["opponent"] == "table:" + ",".join(["0.7500"] * len(TABLE_KEYS))
    again = load_task("poker", self_play=2).self_play
    again.load_state_dict(play.state_dict())
    assert again.options == play.options and again.tables == play.tables


def test_the_row_scores_the_opponent_the_mean_of_the_snapshots_not_the_last_one():
    """``opponent_exploitability`` is the exploitability of the averaged table: two pure tables
    whose mean is the equilibrium score 0 together, each on its own far from it."""
    nash = [NASH[k] for k in TABLE_KEYS]
    low = [max(0.0, 2 * p - 1) for p in nash]  # low + high = 2 × nash at every decision
    high = [2 * p - lo for p, lo in zip(nash, low)]
    assert all(0.0 <= p <= 1.0 for p in low + high)
    play = load_task("poker", self_play=2).self_play
    assert play.metrics() == {"self_play_snapshots": 0}  # nothing adopted yet: no opponent to score
    play.adopt(low)
    alone = play.metrics()["opponent_exploitability"]
    play.adopt(high)
    assert play.metrics()["self_play_snapshots"] == 2
    assert play.metrics()["opponent_exploitability"] == pytest.approx(0.0, abs=1e-9)
    assert alone > 0.05
    assert KuhnPoker.table_exploitability(high) > 0.05


def test_self_play_needs_an_environment_that_has_it():
    with pytest.raises(TaskError, match="no self-play"):
        load_task("guess", self_play=1)
    with pytest.raises(TaskError, match="self_play must be"):
        load_task("poker", self_play=-3)


@pytest.fixture(scope="module")
def backend() -> TorchBackend:
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    return TorchBackend(make_model(tok, TinyArch(), seed=0), tok)


def test_a_prompt_keeps_the_opponent_it_was_dealt_through_rollout_lease_and_replay(backend):
    task = load_task("poker", self_play=1)
    before = task.next_prompts(8)
    task.self_play.adopt([ALWAYS_BET[k] for k in TABLE_KEYS])  # an update between leases
    after = task.next_prompts(8)
    assert all("env_options" not in p.meta for p in before)
    assert all(p.meta["env_options"]["opponent"].startswith("table:1.0000") for p in after)
    # the lease names each prompt's own opponent; a node runs each seed under it
    specs = [episode_spec(task, p) for p in before + after]
    assert "opponent" not in specs[0].options  # the default (fixed) opponent
    assert specs[-1].options["opponent"] == task.self_play.options["opponent"]
    prompts = before + after
    _, groups = run_episodes(
        backend,
        task,
        [s.seed for s in specs],
        4,
        SamplingParams(),
        task.max_episode_tokens,
        seed=3,
        env_options=[dict(s.options) for s in specs],
    )
    rp = Replayer(task, backend.tokenizer)
    wrapped = [RolloutGroup(p.prompt_id, p.text, backend.encode(p.text), g, 0) for p, g in zip(prompts, groups)]
    for p, g in zip(prompts, wrapped):
        assert rp.group(p, g) == [s.reward for s in g.samples]
    # the same episodes claimed for prompts dealt the other opponent do not replay: an always-betting
    # opponent answers differently from the fixed one somewhere in 16 prompts of 4 episodes
    swapped = [type(p)(p.prompt_id, p.text, p.answer, {"env_seed": p.meta["env_seed"]}) for p in after]
    mismatches = 0
    for p, g in zip(swapped, wrapped[8:]):
        try:
            rp.group(p, g)
        except ReplayMismatch:
            mismatches += 1
    assert mismatches > 0
