"""One ``echorl serve`` process on loopback (any free port) for the tests of this folder, with two
users' API keys; stopped after the session whatever happened."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

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
