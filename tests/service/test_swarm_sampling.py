"""``echorl serve --swarm``: sampling requests served by two real node processes (libp2p on
loopback), verified and accounted to the session; requests the swarm cannot take are sampled by
the server. The cut of a node's sample to its request is checked on its own."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx

from echorl.actor.types import SamplingParams
from echorl.service.swarm import cut


def test_a_node_sample_is_cut_to_its_request_as_the_server_would_stop():
    decode = lambda ids: "".join(chr(96 + t) for t in ids)  # 1 -> "a", 2 -> "b", …
    toks, lps = [1, 2, 3, 4, 5, 9], [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6]
    p = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4, stop=[])
    s = cut(toks, lps, p, set(), decode)
    assert (s.tokens, s.logprobs, s.stop_reason) == ([1, 2, 3, 4], lps[:4], "length")
    s = cut(toks, lps, p, {3}, decode)  # a stop token (or EOS) is kept, as Engine.sample keeps it
    assert (s.tokens, s.stop_reason) == ([1, 2, 3], "stop")
    p = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16, stop=["cd"])
    s = cut(toks, lps, p, set(), decode)  # the token completing a stop string ends the sample
    assert (s.tokens, s.logprobs, s.stop_reason) == ([1, 2, 3, 4], lps[:4], "stop")
    p = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16, stop=[])
    assert cut(toks, lps, p, set(), decode).tokens == toks  # ended by the node (EOS or its cap)


def _post(url, key, path, body):
    r = httpx.post(url + path, json=body, headers={"X-API-Key": key}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _result(url, key, request_id, timeout_s=180.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = _post(url, key, "/api/v1/retrieve_future", {"request_id": request_id})
        if out.get("type") != "try_again":
            return out
    raise AssertionError("future never finished")


def _nodes_serving(url, key, tmp_path, procs, session, sampler, prompt):
    """Sample until the swarm answers (nodes join and load the snapshot first); the usage split."""
    body = {
        "sampling_session_id": sampler,
        "seq_id": 0,
        "num_samples": 4,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]},
        "sampling_params": {"max_tokens": 5, "temperature": 1.0},
    }
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, f"a process ended:\n{(tmp_path / 'serve.log').read_text()[-2000:]}"
        out = _result(url, key, _post(url, key, "/api/v1/asample", body)["request_id"])
        assert "error" not in out, out
        assert len(out["sequences"]) == 4 and all(1 <= len(s["tokens"]) <= 5 for s in out["sequences"])
        assert all(len(s["logprobs"]) == len(s["tokens"]) for s in out["sequences"])
        usage = httpx.get(url + "/api/v1/echorl/usage", headers={"X-API-Key": key}, timeout=30).json()["sessions"]
        row = next(s for s in usage if s["session"] == session)
        if row["tokens_sampled_by_nodes"] > 0:
            return row
        time.sleep(1.0)
    raise AssertionError("no sample request was served by the swarm:\n" + (tmp_path / "serve.log").read_text()[-3000:])


def test_sampling_requests_are_served_by_nodes_and_accounted(swarm_server):
    url, key, tmp_path, procs = swarm_server.url, swarm_server.key, swarm_server.tmp, swarm_server.procs
    session = _post(url, key, "/api/v1/create_session", {"tags": [], "sdk_version": "test"})["session_id"]
    body = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": "echorl-tiny",
        "lora_config": {"rank": swarm_server.rank},
    }
    model = _result(url, key, _post(url, key, "/api/v1/create_model", body)["request_id"])["model_id"]
    snap = _post(url, key, "/api/v1/save_weights_for_sampler", {"model_id": model})
    sampler = _result(url, key, snap["request_id"])["sampling_session_id"]
    row = _nodes_serving(url, key, tmp_path, procs, session, sampler, [20, 21, 22])
    assert row["tokens_sampled"] >= row["tokens_sampled_by_nodes"] > 0
    status = swarm_server.status()
    assert sum(p["submissions_accepted"] > 0 for p in status["peers"]) >= 1
    learner = status["learner"]  # the swarm's own figures (Swarm.metrics) in its status
    assert learner["requests_swarm"] >= 1 and learner["samples_from_nodes"] >= 4 and learner["turns"] >= 1


def test_a_swarm_address_that_cannot_be_listened_on_is_one_line(tmp_path):
    (tmp_path / "keys.txt").write_text("tml-" + "ab" * 16 + " alice\n")
    cmd = [sys.executable, "-m", "echorl.cli.main", "serve", "--api-keys", str(tmp_path / "keys.txt")]
    cmd += ["--swarm", "--listen", "/ip4/192.0.2.1/tcp/0"]  # TEST-NET-1: not this machine's
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "echorl serve: cannot listen on 192.0.2.1: Cannot assign requested address"
    ], out.stderr[-2000:]
