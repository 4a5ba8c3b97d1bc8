"""Shared fixtures: ``swarm`` starts real learner/node processes on loopback (tests/swarm.py)
and stops every one of them after the test, whatever happened.

Multi-process tests (the ``swarm`` fixture, and everything under e2e/, lab/ and service/: real
libp2p hosts in separate processes on a shared 2-core machine) are run once more if they fail
(pytest-rerunfailures): a scheduling stall there is not a verdict on the code, while a failure that
repeats is. Every rerun is named in the run's summary (``R``). In-process tests are never rerun.
"""

from pathlib import Path

import pytest
from swarm import Swarm

#: One more try for a multi-process test: two failures in a row fail the run.
MULTIPROCESS_RERUNS = 1
MULTIPROCESS_DIRS = ("e2e", "lab", "service")
TESTS = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = Path(item.fspath).relative_to(TESTS).parts
        if parts[0] in MULTIPROCESS_DIRS or "swarm" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.flaky(reruns=MULTIPROCESS_RERUNS, reruns_delay=2))


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    yield s
    s.stop()
