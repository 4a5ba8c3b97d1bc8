"""bench/versus.py at toy size (3 receivers, 1 MB, 100 Mbit/s): every system's receivers end up
holding a copy whose SHA-256 matches the payload, the rows carry the contract's fields, and a
killed receiver is reported as killed while the survivors still finish. The anchors (Lattica,
Shardcast) need the ``bench`` extra; without it their tests skip with the reason."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from netlab import unavailable
from swarm import ENV

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"system", "seconds", "p50_seconds", "origin_upload_bytes", "cpu_seconds", "lower_bound_seconds"}


def versus(*args: str, timeout: float = 400) -> list[dict]:
    why = unavailable()
    if why:
        pytest.skip(f"network lab unavailable: {why}")
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "versus.py"),
            "--nodes",
            "3",
            "--size-mb",
            "1",
            "--uplink-mbps",
            "100",
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"`{module}` is not installed (the `bench` extra: pip install -e '.[bench]')")


def assert_all_verified(rows: list[dict], systems: set[str]) -> None:
    assert {r["system"] for r in rows} == systems, rows
    for r in rows:
        assert set(r) >= FIELDS, r
        assert r["receivers_verified"] == 3 and r["bad_digests"] == 0, r
        assert 0 < r["p50_seconds"] <= r["seconds"], r
        assert r["lower_bound_seconds"] == pytest.approx(1.0 * 2**20 * 8 / 100e6, rel=0.01), r


def test_echorl_and_one_to_many_deliver_verified_copies():
    rows = versus("--systems", "echorl-direct,one-to-many", "--pace", "0.95")
    assert_all_verified(rows, {"echorl-direct", "one-to-many"})
    assert [r["setting"] for r in rows if r["system"] == "echorl-direct"] == ["fanout4-chunkauto-pace95"]
    by = {r["system"]: r for r in rows}
    # the floor sends every receiver its own copy; echorl's origin sends about one
    assert by["one-to-many"]["origin_upload_copies"] >= 2.9
    assert by["echorl-direct"]["origin_upload_copies"] < 1.5


def test_shardcast_delivers_verified_copies():
    need("shardcast")
    assert_all_verified(versus("--systems", "shardcast", "--shardcast", "1:0.25"), {"shardcast"})


def test_lattica_delivers_verified_copies():
    need("lattica")
    assert_all_verified(versus("--systems", "lattica", "--lattica", "256:4"), {"lattica"})


def test_churn_kills_a_receiver_and_the_survivors_finish():
    rows = versus("--systems", "one-to-many", "--churn", "0.25", "--uplink-mbps", "20")
    (r,) = rows
    assert r["receivers_killed"] == 1 and r["survivors"] == 2, r
    assert r["survivors_verified"] == 2 and r["seconds"] is not None, r
