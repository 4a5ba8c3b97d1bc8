"""A volunteer's first five minutes: bad addresses, a dead learner, a taken port, a shared key
and the end of a run each give one clear line and a meaningful exit status."""

import json
import socket
import subprocess
import sys
import time

import pytest
from swarm import ENV

from echorl.protocol.identity import Identity

PID = Identity.generate().peer_id


def echorl(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "echorl.cli", *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


@pytest.mark.parametrize("cmd", ["node", "status"])
@pytest.mark.parametrize(
    "addr, words",
    [
        ("garbage", "is not a multiaddr"),
        ("/ip4/127.0.0.1/tcp/4001", "has no /p2p/"),
    ],
)
def test_bad_bootstrap_is_one_line_before_any_model_loads(tmp_path, cmd, addr, words):
    extra = ["--key", str(tmp_path / "k")] if cmd == "node" else []
    t0 = time.monotonic()
    out = echorl(cmd, "--bootstrap", addr, *extra)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and words in lines[0] and "e.g." in lines[0], out.stderr
    assert "Traceback" not in out.stderr and "tokens/s" not in out.stderr
    assert time.monotonic() - t0 < 30  # no model was built or loaded


def test_learner_on_a_taken_port_refuses_to_start():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = echorl("learner", "--listen", f"/ip4/127.0.0.1/tcp/{port}", "--steps", "1")
    assert out.returncode == 2
    assert "already in use" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_node_says_why_and_gives_up(tmp_path):
    with socket.socket() as s:  # bound, not listening: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        out = echorl(
            "node",
            "--bootstrap",
            f"/ip4/127.0.0.1/tcp/{port}/p2p/{PID}",
            "--key",
            str(tmp_path / "k"),
            "--give-up-after",
            "4",
            timeout=240,
        )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "connection refused" in out.stderr and "retrying in" in out.stderr
    assert "gave up: no answer from the learner" in out.stderr
    assert "Traceback" not in out.stderr


def test_same_key_refused_and_run_end_is_announced(swarm):
    swarm.start_learner("--steps", "80", "--staleness", "2", "--eval-every", "100")
    first = swarm.start_node("a")
    swarm.wait_for(lambda: "joined:" in swarm.learner_log.read_text(), timeout=180, what="the first node's join")
    twin = swarm.start_node("a", log="twin.log")  # the same key file, while the first is at work
    assert twin.wait(timeout=120) == 2
    assert "another node process with this key" in (swarm.tmp / "twin.log").read_text()
    assert first.wait(timeout=240) == 0  # the learner finished its 80 steps and told the node
    summary = (swarm.tmp / "a.log").read_text()
    assert "is over (final version 80" in summary and "rollout groups accepted" in summary, summary[-2000:]
    assert swarm.learner.wait(timeout=60) == 0
    learner_log = swarm.learner_log.read_text()
    assert "nodes told" in learner_log and "1 nodes told" in learner_log, learner_log[-2000:]


def test_doctor_checks_a_live_learner_and_explains_a_dead_one(swarm, tmp_path):
    bad = echorl("doctor", "--bootstrap", "garbage")
    assert bad.returncode == 2 and "is not a multiaddr" in bad.stderr
    key = tmp_path / "open.key"
    key.write_text("x")
    key.chmod(0o644)
    addr = swarm.start_learner("--steps", "0")
    out = echorl("doctor", "--bootstrap", addr, "--key", str(key), "--download-seconds", "2", "--json", timeout=120)
    report = json.loads(out.stdout)
    rows = {r["check"]: r for r in report["checks"]}
    assert rows["dial"]["status"] == "pass" and "ping" in rows["dial"]["detail"]
    assert rows["run"]["status"] == "pass" and "echorl-demo" in rows["run"]["detail"]
    assert rows["download"]["status"] in ("pass", "warn") and "Mbit/s" in rows["download"]["detail"]
    assert rows["clock"]["status"] == "pass"
    assert rows["key"]["status"] == "fail" and "chmod 600" in rows["key"]["detail"]
    assert out.returncode == 1 and report["ok"] is False  # only because of the key's mode
    assert [r["check"] for r in report["checks"] if r["status"] == "fail"] == ["key"]
    assert rows["reachability"]["status"] == "pass", rows["reachability"]  # not "behind NAT" on one machine
    assert rows["reachability"]["detail"] == "same machine as the learner: it dialled us back at 127.0.0.1"
    time.sleep(10)  # past the learner's liveness sweep (3 s + a 3 s ping): the doctor is gone by now
    assert swarm.status()["peers"] == []  # the doctor's probe is not a node ...
    ledger = echorl("ledger", "--bootstrap", addr, "--json")
    assert ledger.returncode == 0 and json.loads(ledger.stdout)["rows"] == [], ledger.stdout
    swarm.stop()
    log = swarm.learner_log.read_text()
    assert " WARNING " not in log, log[-3000:]  # ... so no warning that it went quiet
    assert "nodes: none" in log, log[-3000:]  # nor a phantom in the summary (its cost integration)
    dead = echorl("doctor", "--bootstrap", addr, "--key", str(tmp_path / "k"), "--json", timeout=120)
    rows = {r["check"]: r for r in json.loads(dead.stdout)["checks"]}
    assert dead.returncode == 1 and rows["dial"]["status"] == "fail" and "refused" in rows["dial"]["detail"]
