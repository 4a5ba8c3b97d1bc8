"""Acceptance with clients nobody here wrote: the unmodified ``tinker`` 0.38.0 client, tinker-cookbook
0.6.1's ``rl_loop`` recipe, and ``logits-sdk`` 0.1.6 (over tinker 0.21.0), each in its own
virtualenv (``make clients``; ``make test`` builds them), pointed at ``echorl serve`` by
``TINKER_BASE_URL``/``LOGITS_BASE_URL`` and an API key. A supervised loop's loss falls; an RL loop's
reward rises, on the default tiny model. Skipped, saying so, only where a client venv is absent."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from echorl.actor.model import default_model

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = Path(__file__).resolve().parent / "clients"
VENVS = {"tinker": ROOT / ".venv-tinker", "logits": ROOT / ".venv-logits"}
RUN_TIMEOUT_S = 900
RL_STEPS, RL_LR = 20, 1e-3
# The cookbook's rl_loop samples unseeded (a different run each time) and logs one batch of 8×8
# per step: over 20 steps its first-3 vs last-3 batches rose by less than 0.05 in 2 of 5 runs. Over
# 40 steps its halves rose by 0.057, 0.10 and 0.08 in 3 runs; one half's mean has a standard error
# of ~0.013, so a server that does not learn stays far below the bar.
COOKBOOK_STEPS, COOKBOOK_RISE = 40, 0.03
"""20 batches of 8 prompts x 8 samples at lr 1e-3 (rank 8, alpha 32): measured here 0.25 -> 0.36
(logits) and 0.28 -> 0.45 (cookbook) from the first three batches to the last three."""


def _start(server, client: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    venv = VENVS[client]
    if not (venv / ".installed").exists():
        pytest.skip(f"{venv.name} is absent: `make clients` builds the {client} client's virtualenv")
    prefix = "LOGITS" if client == "logits" else "TINKER"
    user = "bob" if client == "logits" else "alice"
    env = {**os.environ, **(env or {}), f"{prefix}_BASE_URL": server.url, f"{prefix}_API_KEY": server.keys[user]}
    env.pop("PYTHONPATH", None)  # the client venv, not echorl
    env.update(HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0", PYTHONUNBUFFERED="1")
    cmd = [str(venv / "bin" / "python"), *args]
    return subprocess.Popen(cmd, cwd=CLIENTS, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, what: str) -> dict:
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, f"{what} failed:\n{out[-2000:]}\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def _run(server, client: str, *args: str, env: dict[str, str] | None = None) -> dict:
    return _finish(_start(server, client, *args, env=env), f"{client} {args[0]}")


def _node_share(swarm, user: str) -> float:
    """Of the tokens a user's sessions sampled, the share swarm nodes sampled (usage endpoint)."""
    headers = {"X-API-Key": swarm.keys[user]}
    sessions = httpx.get(swarm.url + "/api/v1/echorl/usage", headers=headers, timeout=30).json()["sessions"]
    by_nodes, sampled = (sum(s[k] for s in sessions) for k in ("tokens_sampled_by_nodes", "tokens_sampled"))
    return by_nodes / max(1, sampled)


@pytest.mark.parametrize("client", ["tinker", "logits"])
def test_supervised_loss_falls(server, client):
    out = _run(server, client, "supervised.py", client, "8")
    assert out["end"] < 0.7 * out["start"], out


def test_two_users_train_at_once(server):
    """Two clients (tinker as alice, logits-sdk as bob), two adapters on one base, at the same time:
    the same data and seed give both the same losses, so neither adapter leaked into the other."""
    procs = [_start(server, c, "supervised.py", c, "6") for c in ("tinker", "logits")]
    outs = [_finish(p, "concurrent supervised") for p in procs]
    for out in outs:
        assert out["end"] < 0.8 * out["start"], out
    assert outs[0]["end"] == pytest.approx(outs[1]["end"], rel=1e-4), outs


def test_cookbook_rl_loop_reward_rises(server, tmp_path):
    out = _run(
        server, "tinker", "cookbook_rl.py", str(default_model()), str(tmp_path / "log"), str(COOKBOOK_STEPS), str(RL_LR)
    )
    assert out["end"] > out["start"] + COOKBOOK_RISE, out


def test_cookbook_rl_loop_samples_through_two_nodes(swarm_server, tmp_path):
    """The same recipe against ``echorl serve --swarm``: its ``sample()`` calls become leases that
    two node processes serve with each step's snapshot (a new adapter version a step), checked and
    paid as rollouts are; the reward still rises, and most tokens were sampled by the nodes."""
    args = (str(default_model()), str(tmp_path / "log"), str(COOKBOOK_STEPS), str(RL_LR))
    out = _run(swarm_server, "tinker", "cookbook_rl.py", *args)
    assert out["end"] > out["start"] + COOKBOOK_RISE, out
    assert swarm_server.peers_served() == 2
    assert _node_share(swarm_server, "alice") > 0.5


def test_logits_rl_loop_samples_through_two_nodes(swarm_server):
    """logits-sdk (tinker 0.21's JSON wire) through the swarm: its plain RL loop, unseeded (the swarm
    never leases a seeded request), over the cookbook test's 40 batches and bar, halves compared."""
    env = {"ECHORL_UNSEEDED": "1"}
    out = _run(
        swarm_server, "logits", "rl_plain.py", "logits", str(default_model()), str(COOKBOOK_STEPS), str(RL_LR), env=env
    )
    assert out["half_end"] > out["half_start"] + COOKBOOK_RISE, out
    assert swarm_server.peers_served() == 2
    assert _node_share(swarm_server, "bob") > 0.5


def test_logits_rl_loop_reward_rises(server):
    out = _run(server, "logits", "rl_plain.py", "logits", str(default_model()), str(RL_STEPS), str(RL_LR))
    assert out["end"] > out["start"] + 0.05, out


@pytest.mark.parametrize("client", ["tinker", "logits"])
def test_forward_sampling_options_state_and_errors(server, client):
    out = _run(server, client, "features.py", client)
    assert out["forward_logprobs_len"] == 8
    assert out["state_path"].startswith("echorl://")
    assert out["n"] == 3 and out["seeded_repeat_equal"] and out["logprobs_match_tokens"]
    assert out["stopped_at_string"] and out["prompt_logprobs"]
    assert out["top_k_error"].endswith("{'detail': 'top_k sampling is not served by echorl (use top_p)'}")
    losses = out["losses"]
    assert losses["saved"] < losses["before"] and losses["after_load"] == pytest.approx(losses["saved"], rel=1e-5)
    if client == "tinker":  # create_training_client_from_state_with_optimizer (0.38)
        assert out["resumed_loss"] == pytest.approx(losses["saved"], rel=1e-5)
