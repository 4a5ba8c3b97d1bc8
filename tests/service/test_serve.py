"""``echorl serve`` over raw HTTP: access control, bounds, ownership, and one training step in
the tinker 0.21 (JSON) wire format. The real clients run in test_clients.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from echorl.service.config import ServeConfig

ROOT = Path(__file__).resolve().parents[2]


def _post(server, path, body, user="alice", **kw):
    headers = {"X-API-Key": server.keys[user]} if user else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60, **kw)


def _result(server, request_id, user="alice"):
    for _ in range(60):
        r = _post(server, "/api/v1/retrieve_future", {"request_id": request_id}, user)
        assert r.status_code == 200, r.text
        if r.json().get("type") != "try_again":
            return r.json()
    raise AssertionError("future never finished")


def _usage(server, user):
    r = httpx.get(server.url + "/api/v1/echorl/usage", headers={"X-API-Key": server.keys[user]}, timeout=30)
    assert r.status_code == 200
    return r.json()["sessions"]


def _model(server, user):
    session = _post(server, "/api/v1/create_session", {"tags": [], "sdk_version": "test"}, user).json()["session_id"]
    body = {"session_id": session, "model_seq_id": 0, "base_model": "echorl-tiny", "lora_config": {"rank": 4}}
    fut = _post(server, "/api/v1/create_model", body, user).json()
    return session, _result(server, fut["request_id"], user)["model_id"]


def test_endpoint_binds_loopback_unless_told():
    assert ServeConfig().host == "127.0.0.1"


def test_no_valid_key_is_401_and_changes_nothing(server):
    before = _usage(server, "alice")
    for headers in ({}, {"X-API-Key": "tml-" + "0" * 32}, {"X-API-Key": "x" * 5000}):
        r = httpx.post(server.url + "/api/v1/create_session", json={"tags": []}, headers=headers, timeout=30)
        assert r.status_code == 401
        assert "API key" in r.json()["detail"]
    assert _usage(server, "alice") == before


def test_unsupported_endpoint_answers_one_line_not_a_hang(server):
    t0 = time.monotonic()
    r = _post(server, "/api/v1/copy_weights", {"source_path": "tinker://x"})
    assert r.status_code == 404
    assert r.json()["detail"] == "echorl serve does not implement POST /api/v1/copy_weights"
    assert time.monotonic() - t0 < 10


def test_bodies_are_bounded(server):
    r = httpx.post(
        server.url + "/api/v1/create_session",
        content=b"{" + b" " * (5 << 20) + b"}",
        headers={"X-API-Key": server.keys["alice"], "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413


def test_sessions_cannot_touch_each_others_models(server):
    session, model = _model(server, "alice")
    assert _post(server, "/api/v1/get_info", {"model_id": model}).status_code == 200
    assert _post(server, "/api/v1/get_info", {"model_id": model}, "bob").status_code == 404
    step = _post(server, "/api/v1/optim_step", {"model_id": model, "adam_params": {"learning_rate": 1e-3}}, "bob")
    assert step.status_code == 404
    fut = _post(server, "/api/v1/save_weights", {"model_id": model, "path": "mine"}).json()
    path = _result(server, fut["request_id"])["path"]
    assert path == f"echorl://{model}/weights/mine"
    assert _post(server, "/api/v1/retrieve_future", {"request_id": fut["request_id"]}, "bob").status_code == 404
    bob_session, bob_model = _model(server, "bob")
    load = {"model_id": bob_model, "path": path, "optimizer": True}
    assert _post(server, "/api/v1/load_weights", load, "bob").status_code == 404
    same = _post(
        server, "/api/v1/load_weights", {"model_id": model, "path": path.replace("echorl", "tinker"), "optimizer": True}
    )
    assert "error" not in _result(server, same.json()["request_id"])
    heartbeat = _post(server, "/api/v1/session_heartbeat", {"session_id": session}, "bob")
    assert heartbeat.status_code == 404


def _datum(tokens, targets, weights):
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": targets, "dtype": "int64", "shape": [len(targets)]},
            "weights": {"data": weights, "dtype": "float32", "shape": [len(weights)]},
        },
    }


def test_json_training_step_lowers_the_loss_and_is_accounted(server):
    session, model = _model(server, "alice")
    data = [_datum([20, 21, 22, 23], [21, 22, 23, 1], [0.0, 1.0, 1.0, 1.0])]
    body = {"model_id": model, "seq_id": 1, "forward_backward_input": {"data": data, "loss_fn": "cross_entropy"}}
    losses = []
    for _ in range(3):
        fut = _post(server, "/api/v1/forward_backward", body).json()
        out = _result(server, fut["request_id"])
        losses.append(out["metrics"]["loss:sum"])
        assert out["loss_fn_outputs"][0]["logprobs"]["shape"] == [4]
        step = _post(server, "/api/v1/optim_step", {"model_id": model, "adam_params": {"learning_rate": 0.01}}).json()
        assert "error" not in _result(server, step["request_id"])
    assert losses[-1] < losses[0]
    row = next(s for s in _usage(server, "alice") if s["session"] == session)
    assert row["tokens_trained"] == 12 and row["requests"] >= 6 and row["cost"] > 0
    mine = f'echorl_serve_session_tokens_trained_total{{session="{session}"}}'
    scraped: dict[str, str] = {}
    for _ in range(120):  # the row reaches /metrics within accounting.EXPORT_EVERY_S (2 s)
        text = httpx.get(server.metrics, timeout=30).text
        scraped = dict(re.findall(r"^(echorl_serve_\S+) (\S+)$", text, re.M))
        if float(scraped.get(mine, 0)) == 12:
            break
        time.sleep(0.25)
    assert float(scraped[mine]) == 12
    assert float(scraped['echorl_serve_user_tokens_trained_total{user="alice"}']) >= 12
    assert float(scraped["echorl_serve_tokens_trained_total"]) >= 12 and float(scraped["echorl_serve_sessions"]) >= 1
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TINKER_API_KEY": server.keys["alice"]}
    cmd = [sys.executable, "-m", "echorl.cli.main", "status", "--serve", server.url, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    shown = json.loads(out.stdout)["sessions"]
    assert next(s for s in shown if s["session"] == session)["tokens_trained"] == 12
    assert {s["user"] for s in shown} == {"alice"}  # a key sees its own user's sessions only


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"forward_backward_input": {"data": [], "loss_fn": "cross_entropy"}}, "no data"),
        ({"forward_backward_input": {"data": [_datum([1, 2], [2, 3], [1.0, 1.0])], "loss_fn": "dpo"}}, "not served"),
        ({"forward_backward_input": {"data": [_datum([1, 2], [2], [1.0])], "loss_fn": "cross_entropy"}}, "shape"),
    ],
)
def test_bad_training_requests_get_one_line(server, body, needle):
    _, model = _model(server, "alice")
    r = _post(server, "/api/v1/forward_backward", {"model_id": model, **body})
    assert r.status_code == 400 and needle in r.json()["detail"]
