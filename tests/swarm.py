"""Test helper: start a learner and node daemons as real OS processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import trio

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def echorl(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "echorl.cli", *args],
        env=ENV,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


class Swarm:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.addr = ""

    def start_learner(self, *args: str, timeout: float = 120.0, log: str = "learner.log") -> str:
        addr_file = self.tmp / "addr"
        addr_file.unlink(missing_ok=True)
        self.learner_log = self.tmp / log
        self.learner = echorl(
            "learner",
            "--addr-file",
            str(addr_file),
            "--metrics-out",
            str(self.tmp / "m.jsonl"),
            *args,
            log=self.learner_log,
        )
        self.procs.append(self.learner)
        deadline = time.monotonic() + timeout
        while not addr_file.exists():
            if self.learner.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("learner did not start:\n" + self.learner_log.read_text()[-3000:])
            time.sleep(0.1)
        self.addr = addr_file.read_text().strip()
        return self.addr

    def start_node(self, name: str, *args: str, log: str = "") -> subprocess.Popen:
        p = echorl(
            "node",
            "--bootstrap",
            self.addr,
            "--key",
            str(self.tmp / f"{name}.key"),
            *args,
            log=self.tmp / (log or f"{name}.log"),
        )
        self.procs.append(p)
        return p

    def metrics(self) -> list[dict]:
        path = self.tmp / "m.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def status(self) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "echorl.cli", "status", "--bootstrap", self.addr, "--json"],
            env=ENV,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            raise RuntimeError(out.stderr[-2000:])
        return json.loads(out.stdout)

    def wait_for(self, pred, timeout: float = 120.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = pred()
            if value:
                return value
            if self.learner.poll() is not None:
                raise RuntimeError("learner exited:\n" + self.learner_log.read_text()[-3000:])
            time.sleep(0.2)
        raise TimeoutError(f"timed out waiting for {what}:\n" + self.learner_log.read_text()[-3000:])

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def safetensors_f32(values) -> bytes:
    """A one-tensor safetensors file of ``values`` (a numpy array) as float32: weights without torch."""
    n = values.size
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + values.astype("<f4").tobytes()


def capability(**fields):
    """A node's capability record as the tests declare it: a CPU torch node at 1 tok/s, free,
    reachable, no listen addresses (``fields`` override)."""
    from echorl.protocol.messages import Capability

    base = dict(engine="torch", device="cpu", memory_bytes=0, tokens_per_s=1.0, price_per_hour=0.0, reachable=True)
    return Capability(**{**base, "listen_addrs": [], **fields})


def run_trio(fn, *args):
    return trio.run(fn, *args)


def signed_submit(
    me, lease, version: int, signer=None, token_ids=(5, 6), logprobs=(-1.0, -2.0), incarnation=None, vary=False
):
    """A ``Submit`` answering every prompt of ``lease`` with the same fabricated sample (``vary``:
    the j-th sample's last token shifted by j, so that a group is not all duplicates, which the
    learner accepts but does not pay), named after and signed by ``signer`` (default ``me``): the
    foreign peer of the attack tests."""
    import secrets

    from echorl.protocol import wire
    from echorl.protocol.messages import RolloutGroup, Sample, Submit

    samples = [
        Sample(
            token_ids=[*token_ids[:-1], token_ids[-1] + j * vary],
            logprobs=list(logprobs),
            finish_reason="length",
            reward_hint=0.0,
        )
        for j in range(lease.group_size)
    ]
    groups = [RolloutGroup(prompt_id=p.prompt_id, samples=samples) for p in lease.prompts]
    signer = signer or me
    msg = Submit(
        run_id="echorl-demo",
        lease_id=lease.lease_id,
        peer_id=signer.peer_id,
        behaviour_version=version,
        groups=groups,
        generate_seconds=0.1,
        nonce=secrets.token_bytes(16),
        incarnation=incarnation,
    )
    return wire.sign(msg, signer)


async def remote_code(coro) -> str:
    """The error code a request was refused with, or "ok"."""
    from echorl.net.host import RemoteError

    try:
        await coro
    except RemoteError as exc:
        return exc.code.value
    return "ok"
