"""Shared fixtures: ``swarm`` starts real learner/node processes on loopback (tests/swarm.py)
and stops every one of them after the test, whatever happened."""

import pytest
from swarm import Swarm


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    yield s
    s.stop()
