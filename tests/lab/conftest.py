"""Fixture ``lab``: a network-namespace lab (tests/netlab.py), torn down after the test; the
test is skipped, with the reason, where namespaces cannot be made (not root, no ip/tc/nft)."""

import pytest
from netlab import Lab, unavailable


@pytest.fixture
def lab():
    why = unavailable()
    if why:
        pytest.skip(f"network lab unavailable: {why}")
    built = Lab(uplink_mbps=100)
    try:
        yield built
    finally:
        built.close()
