"""The console entry: help for every role, keygen, clear errors."""

import json
import subprocess
import sys

import pytest

from echorl.cli.main import COMMANDS


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


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "nope"], "unknown task 'nope'"),
        (["--task", "math", "--task-option", "digits=3"], "unknown option(s) ['digits']"),
        (["--task-option", "digits"], "must look like key=value"),
        (["--model", "."], "is not a Hugging Face model directory"),
        (["--config", "missing.json"], "No such file"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--task", "guess", "--entropy-over", "actions"], "needs a task with legal actions; 'guess' declares none"),
        (["--task", "guess", "--task-option", "self_play=2"], "has no self-play"),
    ],
)
def test_learner_refuses_bad_config_before_starting(tmp_path, args, message):
    result = subprocess.run(
        [sys.executable, "-m", "echorl.cli", "learner", *args, "--addr-file", "addr"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "addr").exists()  # nothing was started


def test_learner_config_file_unknown_key(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"stepz": 3}))
    result = echorl("learner", "--config", str(tmp_path / "c.json"), check=False)
    assert result.returncode == 2 and "unknown learner config keys: ['stepz']" in result.stderr


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("role", ["learner", "node"])
def test_print_config_round_trips_and_a_flag_overrides_the_file(tmp_path, role):
    base = ["--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/x"] if role == "node" else []
    printed = echorl(role, *base, "--seed", "3", "--print-config").stdout
    (tmp_path / "c.toml").write_text(printed)
    assert echorl(role, "--config", str(tmp_path / "c.toml"), "--print-config").stdout == printed
    changed = echorl(role, "--config", str(tmp_path / "c.toml"), "--upload-mbps", "5", "--print-config").stdout
    assert changed == printed.replace("upload_mbps = 0.0", "upload_mbps = 5.0") != printed


@pytest.mark.parametrize("role", ["learner", "node", "train-local", "demo"])
def test_unknown_toml_key_is_one_line_and_exit_2(tmp_path, role):
    (tmp_path / "c.toml").write_text("stepz = 3\n")
    result = echorl(role, "--config", str(tmp_path / "c.toml"), check=False)
    assert result.returncode == 2 and result.stderr == f"echorl {role}: unknown {role} config keys: ['stepz']\n"


PEER = "12D3KooWCa8g8KW57hSe2B8o1K53NCeBWxj2tj9uV9AM7HYQ6feW"  # well formed: the address check passes


def _node(tmp_path, *args):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "echorl.cli",
            "node",
            "--bootstrap",
            f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}",
            "--key",
            str(tmp_path / "node.key"),
            *args,
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "."], "--model . is not a Hugging Face model directory (no config.json)"),
        (["--engine", "vllm"], "vllm is not installed: pip install 'echorl[vllm]' on a CUDA machine"),
        (["--max-prompts", "0"], "--max-prompts (max_prompts): Input should be greater than or equal to 1 (got '0')"),
    ],
)
def test_node_refuses_bad_input_before_anything_heavy(tmp_path, args, message):
    result = _node(tmp_path, *args)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines == [f"echorl node: {message}"], result.stderr
    assert not (tmp_path / "node.key").exists()  # nothing was started


@pytest.mark.skipif(_cuda(), reason="this machine has CUDA")
@pytest.mark.parametrize("role", ["learner", "node", "train-local"])
def test_cuda_asked_without_cuda_is_an_error_not_a_fallback(tmp_path, role):
    base = ["--bootstrap", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}", "--key", str(tmp_path / "k")] if role == "node" else []
    result = subprocess.run(
        [sys.executable, "-m", "echorl.cli", role, *base, "--device", "cuda:0"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"echorl {role}: --device cuda:0: CUDA is not available")
    assert "Traceback" not in result.stderr and not (tmp_path / "k").exists()


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

    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "echorl.cli",
            "demo",
            "--nodes",
            "1",
            "--steps",
            "500",
            "--workdir",
            str(tmp_path),
            "--metrics-out",
            str(tmp_path / "m.jsonl"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not (tmp_path / "node0.log").exists():  # the learner is up and the node was started
        assert demo.poll() is None and time.monotonic() < deadline, demo.stdout.read() if demo.stdout else ""
        time.sleep(0.2)
    assert len(_procs_mentioning(str(tmp_path))) >= 3  # demo, learner, node
    demo.send_signal(signal.SIGTERM)
    out, _ = demo.communicate(timeout=60)
    assert demo.returncode == 130 and "interrupted: stopping the swarm" in out
    assert _procs_mentioning(str(tmp_path)) == []  # nothing orphaned


WATCH_THAT_HANGS = """
import argparse, sys, trio
from echorl.cli import status
status.LEAVE_GRACE_S = 1.0

async def show(args):  # a watch whose host close never ends, even when cancelled
    print("watching", flush=True)
    with trio.CancelScope(shield=True):
        await trio.sleep(60)
    return 0

status._show = show
sys.exit(trio.run(status._main, argparse.Namespace(watch=True)))
"""


def test_ctrl_c_leaves_a_watch_even_when_its_close_hangs():
    """`status --watch` exits 130 within LEAVE_GRACE_S of Ctrl-C even if closing its host hangs
    (a fresh-clone run once waited 120 s for it)."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-c", WATCH_THAT_HANGS], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "watching"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130 and time.monotonic() - t0 < 15
