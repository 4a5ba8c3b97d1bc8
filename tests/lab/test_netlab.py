"""Across namespaces: a learner, a public node and nodes behind NAT, each with its own 198.18
address; the run trains, NAT'd nodes are reported unreachable yet receive every version as
broadcast leaves and contribute rollouts; status from another namespace sees all of them; the
lab leaves nothing behind."""

import json
import re
import subprocess
import sys
import time

from netlab import PREFIX, Lab, lab_namespaces, unavailable
from swarm import ENV

STEPS = 60  # long enough that every node joins before the run ends (8 raced on a fast machine)


def echorl(*args: str) -> list[str]:
    return [sys.executable, "-m", "echorl.cli", *args]


def _wait_file(path, proc, log, timeout=180.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("learner did not start:\n" + log.read_text()[-3000:])
        time.sleep(0.2)
    return path.read_text().strip()


def test_public_and_natted_nodes_train_across_namespaces(lab: Lab, tmp_path):
    learner = lab.add_peer("learner")
    nodes = [lab.add_peer("pub-1"), lab.add_peer("nat-1", nat=True), lab.add_peer("nat-2", nat=True)]
    watcher = lab.add_peer("status")
    addr_file, llog = tmp_path / "addr", tmp_path / "learner.log"
    lp = lab.spawn(
        learner,
        echorl(
            "learner",
            "--listen",
            "/ip4/0.0.0.0/tcp/4001",
            "--addr-file",
            str(addr_file),
            "--steps",
            str(STEPS),
            "--staleness",
            "2",
            "--eval-every",
            "100",
            "--lease-timeout",
            "60",
        ),
        llog,
        env=ENV,
    )
    addr = _wait_file(addr_file, lp, llog)
    assert addr.startswith(f"/ip4/{learner.ip}/tcp/4001/p2p/"), addr  # a real interface, not 0.0.0.0
    procs = {
        n.name: lab.spawn(
            n,
            echorl(
                "node",
                "--bootstrap",
                addr,
                "--key",
                str(tmp_path / f"{n.name}.key"),
                "--listen",
                "/ip4/0.0.0.0/tcp/0",
                "--give-up-after",
                "120",
            ),
            tmp_path / f"{n.name}.log",
            env=ENV,
        )
        for n in nodes
    }
    deadline = time.monotonic() + 240
    status = {}
    while time.monotonic() < deadline:  # every node joined and at work
        out = lab.run(watcher, echorl("status", "--bootstrap", addr, "--json", "--timeout", "20"), env=ENV)
        if out.returncode == 0:
            status = json.loads(out.stdout)
            if len(status["peers"]) == 3 and all(p["leases_done"] > 0 for p in status["peers"]):
                break
        elif lp.poll() is not None:
            break
        time.sleep(1.0)
    assert len(status.get("peers", [])) == 3, (status, llog.read_text()[-3000:])
    reachable = {p["peer_id"]: p["reachable"] for p in status["peers"]}
    assert sorted(reachable.values()) == [False, False, True]  # the NAT'd two are leaves
    for name, p in procs.items():
        assert p.wait(timeout=300) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
        text = (tmp_path / f"{name}.log").read_text()
        assert f"is over (final version {STEPS}" in text, text[-2000:]
        loaded = re.search(r"versions loaded: \{'relay': (\d+), 'fetch': (\d+)", text)
        assert loaded and int(loaded.group(1)) >= 1, text[-2000:]  # versions came through the broadcast
        summary = re.search(r"contributed (\d+) leases, (\d+) rollout groups", text)
        assert summary and int(summary.group(2)) > 0, text[-2000:]  # every node contributed
    assert lp.wait(timeout=60) == 0
    assert "3 nodes told" in llog.read_text()
    nat_logs = [(tmp_path / f"{n.name}.log").read_text() for n in nodes if n.nat]
    assert all("the learner sees this node as /ip4/198.18.0.254" in t for t in nat_logs), nat_logs[0][-2000:]


def test_lab_leaves_nothing_behind():
    why = unavailable()
    if why:
        import pytest

        pytest.skip(f"network lab unavailable: {why}")
    lab = Lab(uplink_mbps=10)
    lab.add_peer("learner")
    lab.add_peer("nat-1", nat=True)
    names = list(lab._namespaces)
    lab.close()
    left = [ns for ns in lab_namespaces() if ns in names]
    assert left == []
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "vpub" not in links and "vnat" not in links
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout
    assert "echorl_lab" not in tables
    assert not any(ns.startswith(PREFIX) and ns.split("-")[2] == names[0].split("-")[2] for ns in lab_namespaces())


def test_doctor_tells_a_public_node_from_a_natted_one(lab: Lab, tmp_path):
    """``echorl doctor`` from a public namespace: the learner dials it back (reachable); from
    behind the NAT: not directly reachable, seen as the NAT's address."""
    learner = lab.add_peer("learner")
    public, natted = lab.add_peer("pub-1"), lab.add_peer("nat-1", nat=True)
    addr_file, llog = tmp_path / "addr", tmp_path / "learner.log"
    lp = lab.spawn(
        learner,
        echorl(
            "learner",
            "--listen",
            "/ip4/0.0.0.0/tcp/4001",
            "--addr-file",
            str(addr_file),
            "--steps",
            "0",
            "--checkpoint-dir",
            "none",
        ),
        llog,
        env=ENV,
    )
    addr = _wait_file(addr_file, lp, llog)
    rows = {}
    for peer in (public, natted):
        out = lab.run(
            peer,
            echorl("doctor", "--bootstrap", addr, "--key", str(tmp_path / "k"), "--download-seconds", "1", "--json"),
            timeout=180,
            env=ENV,
        )
        rows[peer.name] = {r["check"]: r for r in json.loads(out.stdout)["checks"]}
    pub, nat = rows["pub-1"]["reachability"], rows["nat-1"]["reachability"]
    assert pub["status"] == "pass" and f"dialled us back at {public.ip}" in pub["detail"], pub
    assert "no NAT between us" in pub["detail"], pub  # told from a NAT'd node: it sees our own address
    assert nat["status"] == "warn" and "not directly reachable" in nat["detail"], nat
    assert "not an address of this machine: behind NAT" in nat["detail"], nat
    assert "seen as /ip4/198.18.0.254/" in nat["detail"], nat
    assert rows["nat-1"]["dial"]["status"] == "pass" and rows["nat-1"]["run"]["status"] == "pass"
