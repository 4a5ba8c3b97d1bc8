"""``echorl serve`` driven by the unmodified Tinker clients, and the HTTP layer's cost.

    python bench/service.py --json [--sup-steps 8] [--rl-steps 10] [--fwdbwd 30]

Starts one ``echorl serve`` (loopback, any port, the default tiny model, ``--threads 1``) and runs,
for each client whose virtualenv exists (``make clients``: ``.venv-tinker`` = tinker 0.38.0 +
tinker-cookbook 0.6.1, ``.venv-logits`` = logits-sdk 0.1.6), the client scripts of
``tests/service/clients``: ``supervised.py`` (forward_backward + optim_step on addition problems)
and an RL loop (tinker: the cookbook's ``rl_loop`` recipe, ``cookbook_rl.py``; logits: the same
loop on the public API, ``rl_plain.py``). One line per client and loop: ``client``, ``loop``,
``start``, ``end`` (loss, or mean reward of the first vs last batches), ``nodes_sampling``,
``seconds``. ``nodes_sampling`` is 0: the server samples every ``sample()`` itself (sampling by
the swarm, issue 26 item 2, is not built), so the last line's ``swarm_tokens_per_s`` is null and
``learner_tokens_per_s`` is measured (``--samples`` requests of 8 x 16 tokens, raw HTTP).

The same last line holds the HTTP layer's overhead per ``forward_backward``: ``--fwdbwd`` requests
of 8 addition-sized data through HTTP (JSON, tinker 0.21's format: POST + ``retrieve_future``)
against the bare training step (``Engine.forward_backward`` on the same request in this process,
one torch thread like the server), interleaved one by one so both see the same load (the 2 cores
are shared: ``loadavg`` is recorded). ``http_overhead_p50_ms`` = HTTP p50 - bare p50 (and p99).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _report import emit  # noqa: E402

CLIENTS = ROOT / "tests" / "service" / "clients"
START_TIMEOUT_S = 240
RUN_TIMEOUT_S = 1800
RL_LR = 1e-3  # the acceptance tests' (tests/service/test_clients.py)


def start_server(tmp: Path, keys: dict[str, str]) -> tuple[subprocess.Popen, str]:
    (tmp / "keys.txt").write_text("".join(f"{k} {u}\n" for u, k in keys.items()))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "echorl.cli.main", "serve", "--api-keys", str(tmp / "keys.txt"), "--port", "0"]
    cmd += ["--state-dir", str(tmp / "state"), "--threads", "1"]
    with open(tmp / "serve.log", "w") as log:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.startswith("echorl serve: "):
            return proc, line.split()[2]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"echorl serve did not start:\n{(tmp / 'serve.log').read_text()[-3000:]}")


def run_client(url: str, key: str, client: str, venv: Path, args: list[str]) -> dict:
    prefix = "LOGITS" if client == "logits" else "TINKER"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({f"{prefix}_BASE_URL": url, f"{prefix}_API_KEY": key, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"})
    t0 = time.monotonic()
    out = subprocess.run(
        [str(venv / "bin" / "python"), *args],
        cwd=CLIENTS,
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    if out.returncode != 0:
        raise SystemExit(f"{client} {args[0]} failed:\n{out.stderr[-3000:]}")
    last = json.loads(out.stdout.strip().splitlines()[-1])
    return {"start": last["start"], "end": last["end"], "seconds": round(time.monotonic() - t0, 2)}


def _datum(tokens: list[int]) -> dict:
    ids, targets = tokens[:-1], tokens[1:]
    weights = [0.0] * (len(ids) // 2) + [1.0] * (len(ids) - len(ids) // 2)
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": ids}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": targets, "dtype": "int64", "shape": [len(targets)]},
            "weights": {"data": weights, "dtype": "float32", "shape": [len(weights)]},
        },
    }


class Raw:
    """The 0.21 JSON wire format over httpx, for the timing loops."""

    def __init__(self, url: str, key: str) -> None:
        import httpx

        self.http = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120)
        self.session = self.post("/api/v1/create_session", {"tags": [], "sdk_version": "bench"})["session_id"]

    def post(self, path: str, body: dict) -> dict:
        r = self.http.post(path, json=body)
        r.raise_for_status()
        return r.json()

    def result(self, fut: dict) -> dict:
        while True:
            out = self.post("/api/v1/retrieve_future", {"request_id": fut["request_id"]})
            if out.get("type") != "try_again":
                if "error" in out:
                    raise SystemExit(f"request failed: {out['error']}")
                return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def measure_http(url: str, key: str, n_fwdbwd: int, n_samples: int) -> dict:
    import torch

    from echorl.actor.model import default_model
    from echorl.service.engine import Engine
    from echorl.service.wire import Limits, fwdbwd_from_json

    torch.set_num_threads(1)
    raw = Raw(url, key)
    body = {"session_id": raw.session, "model_seq_id": 0, "base_model": "echorl-tiny", "lora_config": {"rank": 8}}
    model_id = raw.result(raw.post("/api/v1/create_model", body))["model_id"]
    data = [_datum([20 + (i + j) % 40 for j in range(14)]) for i in range(8)]
    req = {"model_id": model_id, "forward_backward_input": {"data": data, "loss_fn": "cross_entropy"}}
    engine = Engine(default_model())
    engine.create("bare", engine.lora_spec(8, 32.0, 0, True, True, False))
    bare_req = fwdbwd_from_json(req, Limits(262_144, 4096), forward_only=False)
    http_ms, bare_ms = [], []
    for _ in range(n_fwdbwd):
        t0 = time.perf_counter()
        raw.result(raw.post("/api/v1/forward_backward", req))
        http_ms.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        engine.forward_backward("bare", bare_req)
        bare_ms.append((time.perf_counter() - t0) * 1e3)
    sampler = raw.post(
        "/api/v1/create_sampling_session",
        {"session_id": raw.session, "sampling_session_seq_id": 0, "base_model": "echorl-tiny"},
    )["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [20, 21, 22, 23]}]}
    params = {"max_tokens": 16, "temperature": 1.0}
    tokens, t0 = 0, time.perf_counter()
    for i in range(n_samples):
        fut = raw.post(
            "/api/v1/asample",
            {
                "sampling_session_id": sampler,
                "seq_id": i,
                "num_samples": 8,
                "prompt": prompt,
                "sampling_params": params,
            },
        )
        tokens += sum(len(s["tokens"]) for s in raw.result(fut)["sequences"])
    sample_s = time.perf_counter() - t0
    return {
        "learner_tokens_per_s": round(tokens / sample_s, 1),
        "swarm_tokens_per_s": None,
        "fwdbwd_requests": n_fwdbwd,
        "http_fwdbwd_p50_ms": round(pct(http_ms, 0.5), 2),
        "http_fwdbwd_p99_ms": round(pct(http_ms, 0.99), 2),
        "bare_fwdbwd_p50_ms": round(pct(bare_ms, 0.5), 2),
        "bare_fwdbwd_p99_ms": round(pct(bare_ms, 0.99), 2),
        "http_overhead_p50_ms": round(pct(http_ms, 0.5) - pct(bare_ms, 0.5), 2),
        "http_overhead_p99_ms": round(pct(http_ms, 0.99) - pct(bare_ms, 0.99), 2),
        "http_overhead_mean_ms": round(statistics.fmean(h - b for h, b in zip(http_ms, bare_ms)), 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--sup-steps", type=int, default=8, help="supervised steps per client")
    p.add_argument("--rl-steps", type=int, default=10, help="RL batches (8 prompts x 8 samples) per client")
    p.add_argument("--fwdbwd", type=int, default=30, help="forward_backward requests timed, HTTP vs bare")
    p.add_argument("--samples", type=int, default=10, help="sample requests (8 x 16 tokens) timed")
    p.add_argument("--clients", default="tinker,logits", help="which clients to run (comma-separated)")
    p.add_argument("--venvs", default=str(ROOT), help="folder holding .venv-tinker and .venv-logits")
    args = p.parse_args()
    from echorl.actor.model import default_model

    keys = {user: f"tml-{secrets.token_hex(16)}" for user in ("tinker", "logits")}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        proc, url = start_server(tmp, keys)
        try:
            for client in [c for c in args.clients.split(",") if c]:
                venv = Path(args.venvs) / f".venv-{client}"
                if not (venv / ".installed").exists():
                    emit({"client": client, "skipped": f"{venv} absent (make clients)"}, args.json)
                    continue
                loops = {
                    "supervised": ["supervised.py", client, str(args.sup_steps)],
                    "rl": [
                        "cookbook_rl.py",
                        str(default_model()),
                        str(tmp / "cookbook"),
                        str(args.rl_steps),
                        str(RL_LR),
                    ]
                    if client == "tinker"
                    else ["rl_plain.py", client, str(default_model()), str(args.rl_steps), str(RL_LR)],
                }
                for loop, cmd in loops.items():
                    out = run_client(url, keys[client], client, venv, cmd)
                    emit({"client": client, "loop": loop, **out, "nodes_sampling": 0}, args.json)
            figures = measure_http(url, keys["tinker"], args.fwdbwd, args.samples)
            emit({"bench": "service", **figures, "loadavg": [round(x, 2) for x in os.getloadavg()]}, args.json)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
