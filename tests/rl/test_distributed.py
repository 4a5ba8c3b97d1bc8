"""Data-parallel GRPO (rl/distributed.py): 2 ranks train like 1, checkpoints resume on 2 ranks,
a worker that dies or hangs makes rank 0 fail with a clear error instead of hanging, and a run
that loses its worker ends with a checkpoint and one line, never a traceback. The rendezvous is
a file in a private directory: no rank listens beyond loopback.

Real worker processes over gloo on loopback, the tiny untrained default model, a few steps."""

from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from echorl.actor.types import RolloutGroup, Sample
from echorl.rl.checkpoint import load_checkpoint, restore_trainer, save_checkpoint
from echorl.rl.distributed import DistributedError, DistributedGRPO, split_shares
from echorl.rl.grpo import GRPOConfig, GRPOTrainer

STEPS = 4
CFG = dict(lr=1e-3, micro_batch=3)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread, like the workers: on a shared machine more threads only contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from echorl.actor.model import build_default_model

    return build_default_model(tmp_path_factory.mktemp("m") / "tiny", seed=0, warmup=None)


def _batches(vocab: int, n: int = STEPS) -> list[list[RolloutGroup]]:
    """Deterministic batches: 5 groups of 4 samples (odd count, unequal lengths), one episode
    sample with a model mask, behaviour log-probs off the policy so the clip and the truncation act."""
    rng = random.Random(7)
    out = []
    for step in range(n):
        groups = []
        for g in range(5):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
            samples = []
            for s in range(4):
                ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
                mask = [i % 3 != 1 for i in range(len(ids))] if (g, s) == (1, 2) else None
                samples.append(Sample(ids, [rng.uniform(-6.0, -2.0) for _ in ids], "length", "", mask))
            rewards = [float(rng.random() < 0.5) for _ in samples]
            groups.append(RolloutGroup(f"p{step}-{g}", "", prompt, samples, step, rewards))
        out.append(groups)
    return out


def _params(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.state_dict().items()}


# Two ranks sum their halves in another order than one rank does; Adam's normalised step turns that
# fp32 rounding into ~2e-5 of a tensor (seen under load). A rank that missed the all-reduce is off
# by the size of the update itself (the steps move the weights by > 1e-3), far above this.
CLOSE_REL = 1e-4


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rel: float = CLOSE_REL) -> None:
    assert a.keys() == b.keys()
    for k in a:
        err = float((a[k] - b[k]).norm()) / max(1e-12, float(a[k].norm()))
        assert err < rel, f"{k}: relative difference {err:.2e}"


@pytest.fixture(scope="module")
def two_rank_run(model_dir, tmp_path_factory):
    """An uninterrupted 2-rank run of STEPS steps with a checkpoint after step 2."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    trainer = GRPOTrainer(model_dir, GRPOConfig(**CFG))
    batches = _batches(int(trainer.model.config.vocab_size))
    metrics = []
    with DistributedGRPO(trainer, model_dir, nproc=2, timeout_s=60) as dp:
        for i, b in enumerate(batches):
            metrics.append(dp.train_step(b))
            if i == 1:
                save_checkpoint(ckpt, dp, cursor=0)
        in_sync = dp.ranks_in_sync()
    return {"params": _params(trainer), "metrics": metrics, "ckpt": ckpt, "batches": batches, "in_sync": in_sync}


def test_two_ranks_train_like_one(model_dir, two_rank_run):
    one = GRPOTrainer(model_dir, GRPOConfig(**CFG))
    before = _params(one)
    ref = [one.train_step(b) for b in two_rank_run["batches"]]
    two = two_rank_run["metrics"]
    assert two_rank_run["in_sync"]
    assert [m["version"] for m in two] == list(range(1, STEPS + 1)) and all(m["ranks"] == 2 for m in two)
    for a, b in zip(ref, two):  # the statistics are summed over ranks to the whole batch's
        assert (a["sequences"], a["tokens"]) == (b["sequences"], b["tokens"])
        for k in ("loss", "grad_norm", "ratio_mean", "clip_frac", "tis_frac", "logp_abs_diff"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k
    assert any(m["clip_frac"] > 0 for m in ref) and any(m["tis_frac"] > 0 for m in ref)
    moved = max(float((before[k] - v).norm()) for k, v in _params(one).items())
    assert moved > 1e-3  # the steps did change the weights
    _assert_close(_params(one), two_rank_run["params"])


def test_resume_on_two_ranks_matches_uninterrupted_run(model_dir, two_rank_run):
    trainer = GRPOTrainer(model_dir, GRPOConfig(**CFG))
    bad = [RolloutGroup("x", "", [1, 2], [Sample([10**6], [-1.0], "length", "")] * 2, 0, [0.0, 1.0])]
    with DistributedGRPO(trainer, model_dir, nproc=2, timeout_s=60) as dp:
        before = _params(trainer)
        with pytest.raises(ValueError, match="out of range"):  # refused on rank 0, no rank involved
            dp.train_step(bad)
        assert dp.version == 0 and all(torch.equal(before[k], v) for k, v in _params(trainer).items())
        restore_trainer(dp, load_checkpoint(two_rank_run["ckpt"]), rng=False)
        assert dp.version == 2
        for b in two_rank_run["batches"][2:]:
            dp.train_step(b)
        assert dp.version == STEPS
        # the worker got weights *and* optimizer state: otherwise its replica would drift
        assert dp.ranks_in_sync()
        resumed = _params(trainer)
        with torch.no_grad():
            next(dp.model.parameters()).add_(1e-3)
        assert not dp.ranks_in_sync()  # the check can fail
    _assert_close(two_rank_run["params"], resumed, rel=1e-6)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "hangs"])
def test_lost_worker_fails_loudly(model_dir, sig):
    trainer = GRPOTrainer(model_dir, GRPOConfig(**CFG))
    batches = _batches(int(trainer.model.config.vocab_size), 2)
    dp = DistributedGRPO(trainer, model_dir, nproc=2, timeout_s=5)
    try:
        dp.train_step(batches[0])
        worker = dp.procs[0]
        os.kill(worker.pid, sig)
        if sig == signal.SIGKILL:
            worker.wait()
        t0 = time.monotonic()
        with pytest.raises(
            DistributedError, match="rank 1 exited with code -9" if sig == signal.SIGKILL else "no answer within 5 s"
        ):
            dp.train_step(batches[1])
        assert time.monotonic() - t0 < 30
        assert worker.poll() is not None  # rank 0 did not leave the stopped worker behind
        with pytest.raises(DistributedError, match="down"):
            dp.train_step(batches[1])
    finally:
        dp.close()


def test_split_shares_balances_whole_groups():
    from echorl.rl.grpo import Prepared

    prep = Prepared()
    sizes = {0: [9, 9], 1: [2], 2: [5, 5, 5], 3: [1, 1]}  # tokens per row, by group
    for g, rows in sizes.items():
        for n in rows:
            prep.rows.append(([1], [3] * n, [-1.0] * n, None))
            prep.advs.append(0.0)
            prep.group_of.append(g)
    shares = split_shares(prep, 2)
    owners = [{prep.group_of[i] for i in s} for s in shares]
    assert owners[0].isdisjoint(owners[1]) and owners[0] | owners[1] == set(sizes)
    loads = [sum(len(prep.rows[i][1]) for i in s) for s in shares]
    assert sorted(loads) == [18, 19] and all(s == sorted(s) for s in shares)
    assert split_shares(prep, 6)[5] == [] and sum(map(len, split_shares(prep, 6))) == len(prep.rows)


def _train_local(*args: str, timeout: float = 300, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "echorl.cli", "train-local", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
        cwd=cwd,
    )


def _listening(pid: int) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The local addresses of every listening TCP socket process ``pid`` holds (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            lines = f.read().splitlines()[1:]
        for line in lines:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(cols[1].split(":")[0])
                ip = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))
                out.add(ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip)
    return out


def test_rendezvous_is_a_private_file_and_the_ranks_listen_on_loopback_only(model_dir):
    """Issue 24 finding 5: the TCPStore listened on every interface, unauthenticated (anyone who
    reached it could post the workers' next command). Now: a FileStore in a 0700 directory of this
    run (gone at close), and gloo's own sockets bound to loopback."""
    trainer = GRPOTrainer(model_dir, GRPOConfig(**CFG))
    with DistributedGRPO(trainer, model_dir, nproc=2, timeout_s=60) as dp:
        store_dir = dp._dir
        assert os.stat(store_dir).st_mode & 0o777 == 0o700 and os.listdir(store_dir) == ["store"]
        for pid in (os.getpid(), dp.procs[0].pid):
            addrs = _listening(pid)
            assert addrs and all(ip.is_loopback for ip in addrs), (pid, addrs)
        assert dp.ranks_in_sync()
    assert not os.path.exists(store_dir)


def test_train_local_nproc_flag_is_bounded():
    r = _train_local("--nproc", "0", timeout=60)
    assert r.returncode == 2 and "--nproc (nproc): Input should be greater than or equal to 1" in r.stderr, r.stderr


def test_train_local_with_two_ranks(model_dir, tmp_path):
    """Two ranks through the CLI; with no --checkpoint-dir the run keeps its last checkpoint in
    runs/train-local-<task>-<time>/checkpoints (issue 28: it kept nothing)."""
    metrics = tmp_path / "m.jsonl"
    r = _train_local(
        "--nproc",
        "2",
        "--steps",
        "2",
        "--model",
        str(model_dir),
        "--device",
        "cpu",
        "--actors",
        "1",
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--lease-prompts",
        "2",
        "--eval-every",
        "2",
        "--task-option",
        "n_eval=4",
        "--actor-delay",
        "0",
        "--quiet",
        "--metrics-out",
        str(metrics),
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "learner data-parallel on 2 ranks (gloo)" in r.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2] and all(row["loss"] is not None for row in rows[1:])
    (kept,) = (tmp_path / "runs").glob("train-local-addition-*/checkpoints")
    assert load_checkpoint(kept).version == 2 and str(kept.relative_to(tmp_path)) in r.stderr


def test_train_local_that_loses_its_worker_checkpoints_and_says_so_in_one_line(model_dir, tmp_path):
    """A worker rank killed mid-run: train-local ends at once with exit 1, one line naming the
    lost rank, no traceback, and a checkpoint of the last version it trained."""
    metrics, ck, err = tmp_path / "m.jsonl", tmp_path / "ck", tmp_path / "stderr"
    args = ["--nproc", "2", "--steps", "500", "--model", str(model_dir), "--device", "cpu", "--actors", "1"]
    args += ["--prompts-per-step", "2", "--group-size", "2", "--lease-prompts", "2", "--eval-every", "500"]
    args += ["--task-option", "n_eval=4", "--actor-delay", "0", "--quiet", "--metrics-out", str(metrics)]
    with open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "echorl.cli", "train-local", *args, "--checkpoint-dir", str(ck)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )
        try:
            deadline = time.monotonic() + 240
            while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # step 2 trained
                assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
                time.sleep(0.2)
            (pid,) = json.loads(err.read_text().split("worker pids ")[1].splitlines()[0])
            os.kill(pid, signal.SIGKILL)
            assert proc.wait(timeout=120) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
    text = err.read_text()
    assert "Traceback" not in text, text[-3000:]
    lost = [line for line in text.splitlines() if "rank 1 exited with code -9" in line]
    assert len(lost) == 1 and lost[0].startswith("training stopped at v"), text[-3000:]
    stopped = int(lost[0].split("training stopped at v")[1].split(",")[0])
    assert stopped >= 2 and load_checkpoint(ck).version == stopped


def test_learner_peer_with_two_ranks(swarm):
    """``echorl learner --nproc 2``: rank 0 serves the network from trio and trains with a worker."""
    swarm.start_learner(
        "--steps",
        "3",
        "--staleness",
        "1",
        "--eval-every",
        "3",
        "--eval-prompts",
        "8",
        "--nproc",
        "2",
        "--device",
        "cpu",
        timeout=240,
    )
    node = swarm.start_node("a")
    swarm.wait_for(lambda: swarm.learner.poll() is not None, what="learner to finish", timeout=300)
    log = swarm.learner_log.read_text()
    assert swarm.learner.returncode == 0, log[-3000:]
    assert "learner data-parallel on 2 ranks (gloo)" in log
    assert max(r["step"] for r in swarm.metrics()) == 3
    node.send_signal(signal.SIGTERM)
    node.wait(timeout=30)
