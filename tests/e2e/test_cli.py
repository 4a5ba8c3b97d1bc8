"""The console entry: help for every role, keygen, clear errors."""

import json
import subprocess
import sys

import pytest

from echorl.cli import COMMANDS


def echorl(*args, check=True):
    return subprocess.run([sys.executable, "-m", "echorl.cli", *args], capture_output=True, text=True, check=check)


def test_top_level_help_lists_every_role():
    out = echorl("--help").stdout
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_subcommand_has_help(name):
    result = echorl(name, "--help", check=False)
    assert result.returncode == 0, result.stderr
    assert "usage: echorl " + name in result.stdout


def test_unknown_subcommand_is_an_error():
    result = echorl("teleport", check=False)
    assert result.returncode != 0 and "invalid choice" in result.stderr


def test_keygen_creates_then_reuses_key(tmp_path):
    key = tmp_path / "k"
    first = json.loads(echorl("keygen", "--key", str(key), "--json").stdout)
    second = json.loads(echorl("keygen", "--key", str(key), "--show", "--json").stdout)
    assert first["peer_id"] == second["peer_id"] and first["peer_id"].startswith("12D3KooW")
    assert (key.stat().st_mode & 0o777) == 0o600
    assert echorl("keygen", "--key", str(tmp_path / "missing"), "--show", check=False).returncode == 1


@pytest.mark.parametrize("args, message", [
    (["--task", "nope"], "unknown task 'nope'"),
    (["--task", "math", "--task-option", "digits=3"], "unknown option(s) ['digits']"),
    (["--task-option", "digits"], "must look like key=value"),
    (["--model", "."], "is not a Hugging Face model directory"),
    (["--config", "missing.json"], "No such file"),
    (["--resume"], "--resume needs --checkpoint-dir"),
])
def test_learner_refuses_bad_config_before_starting(tmp_path, args, message):
    result = subprocess.run([sys.executable, "-m", "echorl.cli", "learner", *args, "--addr-file", "addr"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "addr").exists()  # nothing was started


def test_learner_config_file_unknown_key(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"stepz": 3}))
    result = echorl("learner", "--config", str(tmp_path / "c.json"), check=False)
    assert result.returncode == 2 and "unknown learner config keys: ['stepz']" in result.stderr


def _procs_mentioning(text: str) -> list[int]:
    from pathlib import Path

    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text in (d / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(d.name))
        except OSError:
            continue
    return found


def test_demo_sigterm_stops_learner_and_nodes(tmp_path):
    import signal
    import time

    demo = subprocess.Popen([sys.executable, "-m", "echorl.cli", "demo", "--nodes", "1", "--steps", "500",
                             "--workdir", str(tmp_path), "--metrics-out", str(tmp_path / "m.jsonl")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 180
    while not (tmp_path / "node0.log").exists():  # the learner is up and the node was started
        assert demo.poll() is None and time.monotonic() < deadline, demo.stdout.read() if demo.stdout else ""
        time.sleep(0.2)
    assert len(_procs_mentioning(str(tmp_path))) >= 3  # demo, learner, node
    demo.send_signal(signal.SIGTERM)
    out, _ = demo.communicate(timeout=60)
    assert demo.returncode == 130 and "interrupted: stopping the swarm" in out
    assert _procs_mentioning(str(tmp_path)) == []  # nothing orphaned
