"""The README's commands for during and after the demo, run as written (bash, with ``ADDR``,
``CKPT`` and ``WORK`` set as the README says) against a real learner and node: watch (and leave
it with Ctrl-C), credit from the learner and offline, doctor, stop, plot, train on from the
checkpoint with a node."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from swarm import ENV

from echorl.protocol.identity import load_identity

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_commands(tag: str) -> list[str]:
    """The ``echorl`` lines of the README's bash block that starts with ``# <tag>``."""
    m = re.search(rf"```bash\n# {re.escape(tag)}\n(.*?)```", README.read_text(), re.S)
    assert m, f"README lost its '# {tag}' block"
    lines = [ln for ln in m.group(1).splitlines() if ln.strip()]
    assert all(ln.startswith("echorl ") for ln in lines), lines
    return lines


def by_command(lines: list[str]) -> dict[str, str]:
    """Each line by its subcommand (``echorl ledger --receipts`` is ``ledger --receipts``)."""
    out = {}
    for ln in lines:
        words = ln.split()
        key = words[1] + (f" {words[2]}" if words[1] == "ledger" else "")
        out[key] = ln
    return out


def shell(line: str, env: dict, cwd: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", line], env=env, cwd=cwd, start_new_session=True, text=True, **kw)


def run(line: str, env: dict, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", line], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def stop(p: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
    os.killpg(p.pid, sig)
    return p.wait(timeout=timeout)


def test_the_readme_commands_during_and_after_the_demo(swarm, tmp_path):
    ckpt = tmp_path / "ckpt"
    addr = swarm.start_learner("--steps", "0", "--checkpoint-dir", str(ckpt), "--eval-every", "10")  # until stopped
    env = {
        **ENV,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{ENV.get('PATH', '')}",  # `echorl`, as after activate
        "ADDR": addr,
        "CKPT": str(ckpt),
        "WORK": str(tmp_path),
    }
    node = swarm.start_node("node0")  # the demo's first node: its key and state are $WORK/node0*
    swarm.wait_for(lambda: len(swarm.metrics()) >= 4, timeout=300, what="a few steps")
    during = by_command(readme_commands("while the demo runs"))
    assert set(during) == {"status", "ledger --bootstrap", "doctor"}

    watch = shell(during["status"], env, tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = watch.stdout.readline() if watch.stdout else ""
    deadline = time.monotonic() + 120
    seen = first
    while "nodes (" not in seen and time.monotonic() < deadline:
        seen += watch.stdout.readline() if watch.stdout else ""
    assert stop(watch, signal.SIGINT) == 130  # "Ctrl-C leaves" ...
    assert "Traceback" not in (watch.stderr.read() if watch.stderr else "")  # ... quietly
    assert "learner of run echorl-demo" in seen and "nodes (1 joined" in seen, seen

    credit = run(during["ledger --bootstrap"], env, tmp_path)
    assert credit.returncode == 0 and "ledger of run echorl-demo" in credit.stdout, credit.stderr
    assert load_identity(tmp_path / "node0.key").peer_id[-8:] in credit.stdout

    doctor = run(during["doctor"], env, tmp_path)
    assert doctor.returncode == 0 and "same machine as the learner" in doctor.stdout, doctor.stdout + doctor.stderr

    assert stop(swarm.learner) == 0 and stop(node) == 0  # "Stopping": the learner checkpoints, the node leaves
    stopped_at = checkpoint_step(ckpt)
    assert stopped_at >= 4
    after = by_command(readme_commands("after the demo"))
    assert set(after) == {"ledger --receipts", "plot", "learner", "node"}

    offline = run(after["ledger --receipts"], env, tmp_path)
    assert offline.returncode == 0 and "receipts verified offline" in offline.stdout, offline.stderr
    (tmp_path / "runs").mkdir()
    shutil.copy(tmp_path / "m.jsonl", tmp_path / "runs" / "demo-metrics.jsonl")
    figure = run(after["plot"], env, tmp_path)
    assert figure.returncode == 0 and (tmp_path / "runs" / "demo.png").stat().st_size > 10_000, figure.stderr

    extend = shell(after["learner"], env, tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "learner.addr").exists():
            assert extend.poll() is None and time.monotonic() < deadline, "the resumed learner did not start"
            time.sleep(0.5)
        helper = shell(after["node"], env, tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        status = ["echorl", "status", "--bootstrap", (tmp_path / "learner.addr").read_text().strip(), "--json"]
        step = 0
        while step <= stopped_at + 2 and time.monotonic() < deadline:  # it trains on past the finished run's steps
            time.sleep(2.0)
            out = subprocess.run(status, env=env, capture_output=True, text=True, timeout=60)
            step = json.loads(out.stdout)["learner"].get("step") or 0 if out.returncode == 0 else 0
        assert step > stopped_at + 2
        assert stop(helper) == 0  # stopping a node: it returns its lease and exits 0
    finally:
        code = stop(extend) if extend.poll() is None else extend.returncode  # stopping the learner: a checkpoint
    assert code == 0
    assert checkpoint_step(ckpt) > stopped_at + 2


def checkpoint_step(ckpt: Path) -> int:
    """The version of the newest checkpoint (``LATEST`` names ``v00000042`` or ``v00000042-0001``)."""
    return int((ckpt / "LATEST").read_text().strip().lstrip("v").split("-")[0])


def test_the_readme_names_every_command():
    from echorl.cli.main import COMMANDS

    text = README.read_text()
    table = text[text.index("| command | what |") :]
    table = table[: table.index("\n\n")]
    assert not [name for name in COMMANDS if f"`{name}`" not in table]
