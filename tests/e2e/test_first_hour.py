"""A new user's first hour (issue 28): each mistake a user made there is one line that says what
to do and a meaningful exit status; help says what exists."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from keyfiles import KEY_PROBLEMS, unusable_key
from swarm import ENV

PEER = "12D3KooWCa8g8KW57hSe2B8o1K53NCeBWxj2tj9uV9AM7HYQ6feW"  # well formed: the address check passes


def echorl(*args: str, cwd=None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "echorl.cli", *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=timeout
    )


def one_line(result: subprocess.CompletedProcess, code: int = 2) -> str:
    """The single stderr line of a refused command (log lines of the start-up aside)."""
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and " INFO " not in ln]
    assert result.returncode == code and len(lines) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize("kind", KEY_PROBLEMS)
@pytest.mark.parametrize("role", ["node", "learner"])
def test_key_file_problems_are_one_line_and_exit_2(tmp_path, role, kind):
    path, words = unusable_key(tmp_path, kind)
    base = ["--bootstrap", f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}"] if role == "node" else ["--addr-file", "addr"]
    line = one_line(echorl(role, *base, "--key", str(path), cwd=tmp_path))
    assert line.startswith(f"echorl {role}: key file ") or line.startswith(f"echorl {role}: cannot create key file")
    assert words in line and str(path) in line
    assert not (tmp_path / "addr").exists()  # the learner never started


def test_resume_of_a_finished_run_says_how_to_continue_and_writes_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    small = ["--group-size", "2", "--prompts-per-step", "2", "--eval-every", "2", "--checkpoint-dir", str(ckpt)]
    local = ["--actors", "1", "--lease-prompts", "2", "--quiet"]
    done = echorl("train-local", "--steps", "2", *local, *small, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    before = sorted(p.name for p in ckpt.iterdir())
    for role in ("learner", "train-local"):
        line = one_line(echorl(role, "--resume", "--steps", "2", *small, cwd=tmp_path), code=0)
        assert line == (
            f"echorl {role}: the run in {ckpt} is finished (step 2 of --steps 2); nothing to do: raise --steps "
            "(e.g. --steps 4) to continue it"
        )
    assert sorted(p.name for p in ckpt.iterdir()) == before  # no second copy of the last checkpoint


@pytest.mark.parametrize("role", ["learner", "node", "train-local", "demo"])
def test_help_names_every_task_and_says_each_thing_once(role):
    out = echorl(role, "--help")
    assert out.returncode == 0, out.stderr
    options = [" ".join(o.split()) for o in out.stdout.split("\n  -")]  # one entry per flag, unwrapped
    assert not any("Undefined" in o for o in options), options
    assert all(o.count("repeatable") <= 1 for o in options), [o for o in options if o.count("repeatable") > 1]
    if role != "node":
        task = next(o for o in options if o.startswith("-task TEXT"))
        assert all(name in task for name in ("addition", "poker", "guess", "math", "reasoning")), task


def test_a_node_status_and_ledger_pointed_at_another_run_say_which_run_is_served(swarm, tmp_path):
    addr = swarm.start_learner("--run-id", "other-run", "--steps", "0", "--checkpoint-dir", "none")
    t0 = time.monotonic()
    node = swarm.start_node("n", "--give-up-after", "300")
    assert node.wait(timeout=240) == 2  # at once: a refusal that cannot heal is not retried for 5 minutes
    assert time.monotonic() - t0 < 200
    last = (swarm.tmp / "n.log").read_text().strip().splitlines()[-1]
    assert last == (
        f"echorl node: the learner at {addr} serves run 'other-run', not 'echorl-demo': start the node with "
        "--run-id other-run"
    )
    for cmd in ("status", "ledger"):
        line = one_line(echorl(cmd, "--bootstrap", addr, "--run-id", "echorl-demo"))
        assert line == (
            f"echorl {cmd}: the learner at {addr} serves run 'other-run', not 'echorl-demo': use --run-id "
            "other-run (or leave --run-id out)"
        )
    shown = echorl("status", "--bootstrap", addr)  # no --run-id: the served run, named
    assert shown.returncode == 0 and "learner of run other-run" in shown.stdout, shown.stderr
    ledger = echorl("ledger", "--bootstrap", addr, "--json")
    assert ledger.returncode == 0 and json.loads(ledger.stdout)["run_id"] == "other-run", ledger.stderr


def test_status_tables_keep_every_column_when_piped(capsys):
    from echorl.cli.status import render

    peer = {
        "peer_id": PEER,
        "engine": "torch",
        "device": "cpu",
        "version": 123456,
        "rollouts_per_s": 12.5,
        "groups_accepted": 1234567,
        "submissions_rejected": 98765,
        "top_rejection": "logprob_mismatch",
        "alive": True,
        "last_seen_s": 12.25,
        "price_per_hour": 0.25,
        "cost": 123.4567,
    }
    learner = {"peer_id": PEER, "required_rollouts_per_s": 3.25, "available_rollouts_per_s": 9.5, "cost_total": 1.0}
    render({"run_id": "r", "learner": learner, "peers": [peer], "dht_nodes": []})
    out = capsys.readouterr().out  # not a terminal: rich would cut this at 80 columns
    assert "…" not in out
    for cell in ("groups/s", "top reject", "logprob_mismatch", "1234567", "98765", "123.4567", "12.2s", PEER[-8:]):
        assert cell in out, out
    assert "required groups/s" in out and "available groups/s" in out and "μ/s" not in out  # one throughput unit


def _sleeper(seconds: float, code: int = 0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time, sys; time.sleep({seconds}); sys.exit({code})"])


def test_demo_waits_for_a_learner_whose_nodes_left_on_the_run_end(tmp_path):
    from echorl.cli.demo import _watch

    learner, nodes = _sleeper(4), [_sleeper(0), _sleeper(0)]  # nodes told "run over" before the learner exits
    _watch(learner, nodes, tmp_path / "none.jsonl", 10, time.monotonic())
    assert learner.returncode == 0  # it exited on its own: not stopped by the demo (a signal exit was a failure)
    learner, nodes = _sleeper(60), [_sleeper(0, 1), _sleeper(0, 1)]  # nodes that failed: nothing to wait for
    t0 = time.monotonic()
    _watch(learner, nodes, tmp_path / "none.jsonl", 10, t0)
    assert learner.poll() is None and time.monotonic() - t0 < 30
    learner.kill()
    learner.wait()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_serves_metrics_names_its_checkpoint_and_exits_0_after_a_complete_run(tmp_path):
    import urllib.request

    port = _free_port()
    metrics = tmp_path / "m.jsonl"
    demo = subprocess.Popen(
        [sys.executable, "-m", "echorl.cli", "demo", "--nodes", "2", "--steps", "30", "--metrics-port", str(port)]
        + ["--workdir", str(tmp_path / "w"), "--metrics-out", str(metrics)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        cwd=tmp_path,
    )
    served = ""
    deadline = time.monotonic() + 400
    while demo.poll() is None and time.monotonic() < deadline and "echorl_learner_step" not in served:
        time.sleep(1.0)
        try:
            served = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        except OSError:
            pass  # not up yet
    out, _ = demo.communicate(timeout=max(10, deadline - time.monotonic()))
    assert "echorl_learner_step" in served, out[-3000:]  # the learner's /metrics during the demo
    assert demo.returncode == 0, out[-3000:]
    assert f"  metrics: http://127.0.0.1:{port}/metrics" in out
    ckpt = next(line for line in out.splitlines() if line.startswith("checkpoint: ")).split()[1]
    assert (Path(ckpt) / "LATEST").is_file() and Path(ckpt).parent.parent == tmp_path
    assert "groups/s" in out and "rollouts/s" not in out and "summary: 30 steps" in out


ROOT = Path(__file__).resolve().parents[2]


def test_make_demo_sets_up_only_the_demo_and_says_what_it_does():
    demo = subprocess.run(["make", "-n", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    test = subprocess.run(["make", "-n", "-B", "setup-test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert demo.returncode == 0 and test.returncode == 0, demo.stderr + test.stderr
    setup = _code((ROOT / "scripts" / "setup.sh").read_text())
    for text in (demo.stdout, setup, _code((ROOT / "scripts" / "ensure-build-deps.sh").read_text())):
        assert "nftables" not in text and "iproute2" not in text and "ensure-lab-deps" not in text
    assert "ensure-lab-deps" in test.stdout  # the network lab's system tools belong to the tests' set-up
    assert re.findall(r"-e '(\S+)'", setup) == [".[plot]"]  # the demo's extra only (no test extras)
    assert set(re.findall(r"say (\d) ", setup)) == {"1", "2", "3", "4"} and "[%s/4]" in setup  # a line per step


def _code(script: str) -> str:
    """A shell script without its comment lines."""
    return "\n".join(ln for ln in script.splitlines() if not ln.lstrip().startswith("#"))


def test_the_package_builds_without_a_warning_and_carries_its_data(tmp_path):
    """The editable install `make setup` does (setuptools' always warned 'Editable installation'),
    and the wheel: the default model and the task data travel with the code."""
    import zipfile

    build = (
        "import sys, warnings\n"
        "from flit_core import buildapi\n"
        "warnings.simplefilter('always')\n"
        "print(buildapi.build_editable(sys.argv[1]), buildapi.build_wheel(sys.argv[2]))\n"
    )
    (tmp_path / "e").mkdir()
    (tmp_path / "w").mkdir()
    out = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path / "e"), str(tmp_path / "w")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    editable, wheel = out.stdout.split()
    names = zipfile.ZipFile(tmp_path / "w" / wheel).namelist()
    assert "echorl/actor/default_model/model.safetensors" in names and "echorl/tasks/data/math_sample.jsonl" in names
    assert not any("__pycache__" in n for n in names)
    pth = [n for n in zipfile.ZipFile(tmp_path / "e" / editable).namelist() if n.endswith(".pth")]
    assert len(pth) == 1  # a path entry: the working tree is what runs
