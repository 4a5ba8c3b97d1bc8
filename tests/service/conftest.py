"""One ``echorl serve`` process on loopback (any free port) for the tests of this folder, with two
users' API keys; and one ``echorl serve --swarm`` with two node processes joined to it (libp2p on
loopback) for the tests of sampling by the swarm. Stopped after the session whatever happened."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from swarm import Swarm

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240  # model load and imports on a busy 2-core machine


@dataclass
class Server:
    url: str
    keys: dict[str, str]  # user -> key
    state_dir: Path
    log: Path
    metrics: str  # the /metrics URL (--metrics-port)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    keys = {user: f"tml-{secrets.token_hex(16)}" for user in ("alice", "bob")}
    (tmp / "keys.txt").write_text("".join(f"{k} {u}\n" for u, k in keys.items()))
    log = tmp / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "echorl.cli.main", "serve", "--api-keys", str(tmp / "keys.txt"), "--port", "0"]
    cmd += ["--state-dir", str(tmp / "state"), "--max-body-mb", "4", "--poll-wait-s", "5"]
    cmd += ["--metrics-port", "127.0.0.1:0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=out, text=True, env=env, cwd=tmp)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        url = metrics = None
        while time.monotonic() < deadline and url is None:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            if line.startswith("echorl serve: "):
                url = line.split()[2]
                metrics = next((w.removeprefix("metrics=") for w in line.split() if w.startswith("metrics=")), "")
        if url is None:
            pytest.fail(f"echorl serve did not start:\n{log.read_text()[-3000:]}")
        yield Server(url=url, keys=keys, state_dir=tmp / "state", log=log, metrics=metrics or "")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


SWARM_RANK = 8
"""The swarm's adapter rank: the clients' (tests/service/clients use rank 8)."""
NODE_ENV = {
    **os.environ,
    "PYTHONPATH": str(ROOT),
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
}


@dataclass
class SwarmServer:
    url: str
    key: str  # alice's
    keys: dict[str, str]
    addr: str  # the swarm's bootstrap address
    tmp: Path
    procs: list[subprocess.Popen]
    rank: int = SWARM_RANK

    def status(self) -> dict:
        """The swarm's own status (``echorl status --bootstrap``): its learner row and peers."""
        cmd = [sys.executable, "-m", "echorl.cli", "status", "--bootstrap", self.addr, "--json"]
        out = subprocess.run(cmd, capture_output=True, text=True, env=NODE_ENV, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    def peers_served(self) -> int:
        """Nodes with an accepted submission."""
        return sum(p["submissions_accepted"] > 0 for p in self.status()["peers"])


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=NODE_ENV, start_new_session=True
    )


@pytest.fixture(scope="session")
def swarm_server(tmp_path_factory):
    """``echorl serve --swarm`` (a short swarm wait and cap: the tests' requests are small) and two
    ``echorl node`` processes; yields once both joined."""
    tmp = tmp_path_factory.mktemp("swarm")
    keys = {user: f"tml-{secrets.token_hex(16)}" for user in ("alice", "bob")}
    (tmp / "keys.txt").write_text("".join(f"{k} {u}\n" for u, k in keys.items()))
    cmd = [sys.executable, "-m", "echorl.cli.main", "serve", "--api-keys", str(tmp / "keys.txt"), "--port", "0"]
    cmd += ["--state-dir", str(tmp / "state"), "--poll-wait-s", "2", "--swarm", "--swarm-lora-rank", str(SWARM_RANK)]
    cmd += ["--swarm-wait-s", "60", "--swarm-max-tokens", "8", "--run-id", "swarm-test", "--prompts-per-lease", "2"]
    procs = [_spawn(cmd, tmp / "serve.log")]
    try:
        deadline, line = time.monotonic() + START_TIMEOUT_S, ""
        while time.monotonic() < deadline and not line.startswith("echorl serve: "):
            line = procs[0].stdout.readline()
            if not line and procs[0].poll() is not None:
                break
        if not line.startswith("echorl serve: "):
            pytest.fail("echorl serve --swarm did not start:\n" + (tmp / "serve.log").read_text()[-3000:])
        words = dict(w.split("=", 1) for w in line.split()[3:] if "=" in w)
        for name in ("n1", "n2"):
            node = [sys.executable, "-m", "echorl.cli", "node", "--bootstrap", words["swarm"], "--run-id", "swarm-test"]
            node += ["--key", str(tmp / f"{name}.key"), "--state-dir", str(tmp / name)]
            procs.append(_spawn(node, tmp / f"{name}.log"))
        while (tmp / "serve.log").read_text().count(" joined: ") < 2:  # both nodes are members
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.fail("the nodes did not join echorl serve --swarm:\n" + (tmp / "serve.log").read_text()[-3000:])
            time.sleep(0.2)
        yield SwarmServer(line.split()[2], keys["alice"], keys, words["swarm"], tmp, procs)
    finally:
        stopper = Swarm(tmp)  # tests/swarm.py: SIGTERM, then kill what outlives the wait
        stopper.procs = procs
        stopper.stop()
