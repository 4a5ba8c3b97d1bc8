"""Shared fixtures: ``swarm`` starts real learner/node processes on loopback (tests/swarm.py)
and stops every one of them after the test, whatever happened.

A test that fails is run once more (pytest-rerunfailures): a deterministic test fails again, so a
rerun can only pass a test whose outcome depends on timing — real libp2p hosts, processes and
clocks on a shared 2-core machine, where a scheduling stall is not a verdict on the code. Every
rerun is named in the run's summary (``RERUN``), so a test that needs one is in view.
"""

import pytest
from swarm import Swarm

#: One more try: two failures in a row fail the run.
RERUNS = 1


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.flaky(reruns=RERUNS, reruns_delay=2))


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    yield s
    s.stop()
