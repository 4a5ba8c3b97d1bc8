"""The learner's console (learner/console.py): a progress line when the run moves, the hint
while no node has joined, nothing repeated while nothing changes."""

from __future__ import annotations

import trio

from echorl.learner.console import Progress, progress_line, waiting_hint, watch


def _p(step: int, nodes: int = 2, ev: float | None = 0.5) -> Progress:
    return Progress(step, 700, ev, nodes, 3, 4, 41.25)


def test_progress_line_says_step_eval_nodes_staleness_and_rates():
    line = progress_line(_p(120), _p(100), 10.0)
    assert line == "step 120/700 · eval 0.500 · 2 nodes · staleness ≤ 3 (S=4) · 2.00 steps/s · 41.2 groups/s"
    assert "eval -" in progress_line(_p(1, ev=None), None, 10.0) and "- steps/s" in progress_line(_p(1), None, 0)


def test_waiting_hint_names_the_command_and_a_run_other_than_the_default():
    assert waiting_hint("/ip4/1.2.3.4/tcp/5/p2p/X", "echorl-demo").endswith(
        "echorl node --bootstrap /ip4/1.2.3.4/tcp/5/p2p/X"
    )
    assert waiting_hint("A", "mine").endswith("--bootstrap A --run-id mine")


def test_watch_hints_while_alone_then_reports_progress_only_when_it_moves():
    said: list[str] = []
    state = {"p": _p(0, nodes=0, ev=None)}

    async def main() -> None:
        async with trio.open_nursery() as n:
            n.start_soon(
                lambda: watch(
                    lambda: state["p"], "ADDR", "echorl-demo", every_s=0.05, hint_every_s=0.05, say=said.append
                )
            )
            await trio.sleep(0.22)  # alone: hints, no progress line (nothing trained)
            assert said and all(s.startswith("waiting for nodes") for s in said)
            said.clear()
            state["p"] = _p(5)
            await trio.sleep(0.22)
            assert said == [s for s in said if s.startswith("step 5/700")] and len(said) == 1  # once, not repeated
            n.cancel_scope.cancel()

    trio.run(main)
