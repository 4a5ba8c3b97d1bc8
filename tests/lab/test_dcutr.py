"""Hole punching across two NATs (bench/netlab_dcutr.py): the lab builds a second NAT that is torn
down like the first; the experiment reaches B through the relay, tries py-libp2p's DCUtR and a
plain TCP simultaneous open, reports every outcome in one JSON line and leaves no namespace."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from netlab import PREFIX, Lab, lab_namespaces, unavailable
from swarm import ENV

BENCH = Path(__file__).resolve().parents[2] / "bench" / "netlab_dcutr.py"


@pytest.fixture(autouse=True)
def _lab_available():
    why = unavailable()
    if why:
        pytest.skip(f"network lab unavailable: {why}")


def test_second_nat_has_its_own_lan_and_public_address_and_is_torn_down():
    lab = Lab(nat_silent=True)
    try:
        first, second = lab.add_peer("a", nat=True), lab.add_peer("b", nat=True, nat_index=1)
        assert (first.ip, second.ip) == ("198.18.1.2", "198.18.2.2")
        route = lab.run(second, ["ip", "route", "show", "default"]).stdout
        assert "via 198.18.2.1" in route
        public = subprocess.run(
            ["ip", "-n", lab._nat_ns[1], "-o", "addr", "show", "eth0"], capture_output=True, text=True
        ).stdout
        assert "198.18.0.253/24" in public
        with pytest.raises(ValueError):
            lab.add_peer("c", nat=True, nat_index=2)
        names = list(lab._namespaces)
    finally:
        lab.close()
    assert not set(names) & set(lab_namespaces())
    assert "echorl_lab" not in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout


def test_dcutr_experiment_reports_its_outcome_and_leaves_nothing():
    """Silent NATs (the setting where hole punching can work): B is reached through the relay,
    DCUtR is attempted, and a direct_ok claim is backed by a non-circuit connection to NAT 1's
    public address; the outcome itself is what the lab measured, reported either way."""
    proc = subprocess.Popen(
        [sys.executable, str(BENCH), "--json", "--nat", "silent"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=ENV,
    )
    stdout, _ = proc.communicate(timeout=58)
    assert proc.returncode == 0, stdout[-2000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["nat"] == "silent"
    assert result["relayed_ok"] is True and result["b_reserved"] is True, result
    assert result["dcutr_attempted"] is True, result
    for key in ("direct_ok", "manual_ok"):
        assert isinstance(result[key], bool), result
    if result["direct_ok"]:
        direct = [a for a in result["detail"]["conns_after_dcutr"] if "/p2p-circuit" not in a]
        assert direct and direct[0].startswith("/ip4/198.18.0.253/tcp/"), result
    else:
        assert result["error"] or result["detail"].get("dcutr_returned") is False, result
    assert not [ns for ns in lab_namespaces() if ns.startswith(f"{PREFIX}{proc.pid}-")]
