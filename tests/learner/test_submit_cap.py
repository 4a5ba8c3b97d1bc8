"""The SUBMIT route's frame cap (``admission.submit_cap``) fits the largest honest submission of
the run: for an episodic task that is a transcript of ``max_episode_tokens`` per sample, not one
turn's ``max_new_tokens`` (docs/protocol.md §1.1, "The submit cap"; issue 24, finding 8)."""

from __future__ import annotations

from typing import Any

from echorl.learner.config import ServiceFields
from echorl.learner.service import LearnerService
from echorl.protocol import routes, wire
from echorl.protocol.identity import Identity
from echorl.protocol.messages import RolloutGroup, Sample, Submit
from echorl.rl.buffer import StalenessBuffer
from echorl.tasks import load_task

GROUP, PROMPTS = 4, 3


class _Host:
    """What ``LearnerService.install`` hands the host: the handlers and the per-route caps."""

    def __init__(self) -> None:
        self.caps: dict[str, int] = {}

    def serve(self, handlers: Any, admit: Any = None, max_request_bytes: dict[str, int] | None = None) -> None:
        self.caps = dict(max_request_bytes or {})


def _installed_cap(task: Any) -> int:
    settings = ServiceFields(group_size=GROUP, prompts_per_lease=PROMPTS, prompts_per_step=PROMPTS, staleness=2)
    svc = LearnerService(Identity.generate(), "run", task, None, StalenessBuffer(2), settings, 100)
    host = _Host()
    svc.install(host)  # type: ignore[arg-type]
    return host.caps[routes.SUBMIT]


def _largest_submit(tokens: int, episodic: bool) -> bytes:
    """A Submit of PROMPTS groups of GROUP samples, each ``tokens`` long, with the widest values."""
    ident = Identity.generate()
    sample = Sample(
        token_ids=[2**31 - 1] * tokens,
        logprobs=[-99.123456789] * tokens,
        finish_reason="length",
        reward_hint=-1.2345678901,
        model_mask=[True] * tokens if episodic else None,
    )
    groups = [RolloutGroup(prompt_id=f"p{'x' * 250}{i}", samples=[sample] * GROUP) for i in range(PROMPTS)]
    msg = Submit(
        run_id="run",
        lease_id="L" * 256,
        peer_id=ident.peer_id,
        behaviour_version=2**53,
        groups=groups,
        generate_seconds=86399.5,
        nonce=bytes(32),
        incarnation=bytes(16),
    )
    return wire.encode(wire.sign(msg, ident))


def test_an_honest_episode_submission_fits_the_submit_cap() -> None:
    task = load_task("guess", seed=0)
    assert task.max_episode_tokens > task.max_new_tokens  # a transcript is many turns
    assert len(_largest_submit(task.max_episode_tokens, episodic=True)) <= _installed_cap(task)


def test_a_completion_submission_fits_and_the_cap_stays_tight() -> None:
    task = load_task("addition", digits=2, seed=0)
    cap = _installed_cap(task)
    assert len(_largest_submit(task.max_new_tokens, episodic=False)) <= cap
    assert cap < 2 * len(_largest_submit(task.max_new_tokens, episodic=False)) + 8 * 1024  # not the frame cap
