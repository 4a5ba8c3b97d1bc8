"""Exact evaluation: the task's expected reward from the policy's probabilities, no sampling."""

from __future__ import annotations

import math
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kuhn import TablePolicy

from echorl.actor.types import SamplingParams
from echorl.tasks import load_task
from echorl.tasks.base import Query
from echorl.tasks.poker import FIXED, KuhnPoker, best_response_value, fixed_opponent, seat_value


def test_poker_exact_eval_is_the_game_value_of_the_strategy():
    strategy = {(c, h): 0.3 + 0.2 * c for c in range(3) for h in ("", "01", "0", "1")}
    expected = (
        seat_value(lambda c, h: strategy[(c, h)], fixed_opponent, 1)
        + seat_value(lambda c, h: strategy[(c, h)], fixed_opponent, 2)
    ) / 2
    assert KuhnPoker().exact_eval(TablePolicy(strategy)) == pytest.approx(expected, abs=1e-12)
    best = (best_response_value(fixed_opponent, 1) + best_response_value(fixed_opponent, 2)) / 2
    br = {k: 1.0 if v else 0.0 for k, v in _best_response().items()}
    assert KuhnPoker().exact_eval(TablePolicy(br)) == pytest.approx(best, abs=1e-12)
    # an agent that never answers 0/1 forfeits its ante at its first turn, every hand
    assert KuhnPoker(seat=1).exact_eval(TablePolicy(strategy, forfeit=1.0)) == pytest.approx(-1.0)
    assert FIXED  # the fixed opponent is the default one


def _best_response() -> dict[tuple[int, str], bool]:
    import itertools

    best, arg = -math.inf, {}
    for seat, hs in ((1, ("", "01")), (2, ("0", "1"))):
        sets = [(c, h) for c in range(3) for h in hs]
        best = -math.inf
        for bits in itertools.product((0.0, 1.0), repeat=len(sets)):
            t = dict(zip(sets, bits))
            v = seat_value(lambda c, h, t=t: t[(c, h)], fixed_opponent, seat)
            if v > best:
                best, choice = v, t
        arg.update({k: bool(v) for k, v in choice.items()})
    return arg


@pytest.fixture(scope="module")
def tiny_backend():
    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import default_model

    return TorchBackend.from_pretrained(default_model())  # the shipped model: it answers, then EOS


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_model_policy_matches_what_the_actor_samples(tiny_backend, temperature):
    """The probability of a turn is exp(sum of the log-probs) the actor reports for it: for an
    answer that ended with EOS, and for a poker action given the transcript."""
    from echorl.rl.exact_eval import ModelPolicy

    policy = ModelPolicy(tiny_backend, temperature)
    params = SamplingParams(temperature=temperature, max_new_tokens=5)
    (samples,) = tiny_backend.generate(["12+34="], 16, params, seed=1)
    ended = [s for s in samples if s.finish_reason == "stop" and s.text]
    assert ended
    got = policy.probs([Query(("12+34=",), s.text, True) for s in ended])
    for s, p in zip(ended, got):
        assert p == pytest.approx(math.exp(sum(s.logprobs)), rel=1e-4)
    turns = ("K2:1=",)
    (actions,) = tiny_backend.generate(["K2:1="], 8, SamplingParams(temperature=temperature, max_new_tokens=1), seed=2)
    assert any(s.text for s in actions)
    for s in (s for s in actions if s.text):  # an EOS action decodes to "" (a forfeit)
        (p,) = policy.probs([Query(turns, s.text, False)])
        assert p == pytest.approx(math.exp(s.logprobs[0]), rel=1e-4)


def test_addition_exact_eval_is_the_expected_accuracy(tiny_backend):
    """Exact accuracy = mean P(answer, EOS); a sampled estimate of it lands within 4 standard errors."""
    from echorl.rl.exact_eval import ModelPolicy

    task = load_task("addition", digits=1, seed=0, n_eval=8)
    prompts = task.eval_prompts()
    policy = ModelPolicy(tiny_backend, 1.0)
    exact = task.exact_eval(prompts, policy)
    probs = policy.probs([Query((p.text,), p.answer, True) for p in prompts])
    assert exact == pytest.approx(sum(probs) / len(probs)) and 0.0 < exact < 1.0
    n = 64
    rows = [tiny_backend.encode(p.text) for p in prompts for _ in range(n)]
    samples = tiny_backend.sample_ids(rows, SamplingParams(max_new_tokens=task.max_new_tokens), seed=3)
    hits = sum(task.reward(prompts[i // n], s.text) for i, s in enumerate(samples)) / len(samples)
    se = math.sqrt(max(exact * (1 - exact), 1e-3) / len(samples))
    assert abs(hits - exact) < 4 * se, (hits, exact)


def test_poker_exploitability_reads_the_policy_in_both_seats():
    """The equilibrium as a model's answers: exploitability 0; the best response to the fixed
    opponent (what the agent learns against it) is itself exploitable."""
    from echorl.tasks.poker import nash_p1, nash_p2

    nash = {
        (c, h): (nash_p1(1 / 6) if h in ("", "01") else nash_p2)(c, h) for c in range(3) for h in ("", "01", "0", "1")
    }
    assert KuhnPoker().exact_metrics(TablePolicy(nash))["exploitability"] == pytest.approx(0.0, abs=1e-12)
    br = {k: 1.0 if v else 0.0 for k, v in _best_response().items()}
    assert KuhnPoker().exact_metrics(TablePolicy(br))["exploitability"] > 0.1
