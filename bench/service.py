"""``echorl serve`` driven by the unmodified Tinker clients, sampling by the swarm, and the HTTP layer's cost.

    python bench/service.py --json [--nodes 2] [--together] [--model DIR] [--rl-steps 10] [--fwdbwd 30]

Starts one ``echorl serve`` (loopback, any port, the default tiny model, ``--threads 1``) with
``--swarm`` and ``--nodes`` ``echorl node`` processes joined to it (0: no swarm), and runs, for each
client whose virtualenv exists (``make clients``: ``.venv-tinker`` = tinker 0.38.0 +
tinker-cookbook 0.6.1, ``.venv-logits`` = logits-sdk 0.1.6), the client scripts of
``tests/service/clients``: ``supervised.py`` (forward_backward + optim_step on addition problems)
and an RL loop (tinker: the cookbook's ``rl_loop`` recipe, ``cookbook_rl.py``; logits: the same
loop on the public API, ``rl_plain.py``, unseeded so that the swarm takes its requests). One line
per client and loop: ``client``, ``loop``, ``start``, ``end`` (loss, or mean reward of the first vs
last batches), ``nodes_sampling`` (nodes with an accepted submission so far, from the swarm's
status), ``node_token_share`` (of the loop's sampled tokens, those nodes sampled), ``seconds``.
``--together`` then runs both clients' RL loops at once (two users, two adapters, one swarm:
``rl_together`` lines); ``--model DIR`` serves another local model (SmolLM2: ``echorl
import-gguf``) on the server and the nodes.

The last line: ``swarm_tokens_per_s`` vs ``learner_tokens_per_s``: ``--samples`` requests of 8 x 16
tokens sent at once on a fresh snapshot of the swarm's adapter shape, unseeded (the swarm takes
them) vs the same with a seed (the server samples them: it never leases a seeded request), in the
same run; and the HTTP layer's overhead per ``forward_backward``: ``--fwdbwd`` requests of 8
addition-sized data through HTTP (JSON, tinker 0.21's format: POST + ``retrieve_future``) against
the bare training step (``Engine.forward_backward`` on the same request in this process, one
torch thread like the server), interleaved one by one so both see the same load (the 2 cores are
shared: ``loadavg`` is recorded). ``http_overhead_p50_ms`` = HTTP p50 - bare p50 (and p99).
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _report import emit  # noqa: E402

CLIENTS = ROOT / "tests" / "service" / "clients"
START_TIMEOUT_S = 240
RUN_TIMEOUT_S = 1800
RL_LR = 1e-3  # the acceptance tests' (tests/service/test_clients.py)


SWARM_RANK = 8  # the client scripts' LoRA rank: the swarm samples adapters of this shape only
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def start_server(
    tmp: Path, keys: dict[str, str], nodes: int, model: str, swarm_wait_s: float = 30.0, prompts_per_lease: int = 8
) -> tuple[list[subprocess.Popen], str, str, str]:
    """The server (with ``--swarm`` when ``nodes``) and its nodes, all on ``model`` (a directory;
    "": the shipped tiny model); (processes, URL, swarm address, the served model's name)."""
    (tmp / "keys.txt").write_text("".join(f"{k} {u}\n" for u, k in keys.items()))
    cmd = [sys.executable, "-m", "echorl.cli.main", "serve", "--api-keys", str(tmp / "keys.txt"), "--port", "0"]
    cmd += ["--state-dir", str(tmp / "state"), "--threads", "1", *(["--model", model] if model else [])]
    if nodes:
        cmd += ["--swarm", "--swarm-lora-rank", str(SWARM_RANK), "--swarm-max-tokens", "16", "--run-id", "bench"]
        cmd += ["--swarm-wait-s", str(swarm_wait_s), "--prompts-per-lease", str(prompts_per_lease)]
    with open(tmp / "serve.log", "w") as log:  # the child holds its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=ENV)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout else ""
        if line.startswith("echorl serve: "):
            addr = next((w.removeprefix("swarm=") for w in line.split() if w.startswith("swarm=")), "")
            procs = [proc]
            for i in range(nodes):
                node = [sys.executable, "-m", "echorl.cli", "node", "--bootstrap", addr, "--run-id", "bench"]
                node += ["--key", str(tmp / f"n{i}.key"), "--state-dir", str(tmp / f"n{i}")]
                node += ["--model", model] if model else []
                with open(tmp / f"n{i}.log", "w") as nlog:
                    procs.append(subprocess.Popen(node, stdout=nlog, stderr=subprocess.STDOUT, env=ENV))
            name = next(w.removeprefix("base_model=") for w in line.split() if w.startswith("base_model="))
            return procs, line.split()[2], addr, name.strip("'\"")
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit(f"echorl serve did not start:\n{(tmp / 'serve.log').read_text()[-3000:]}")


def nodes_sampling(addr: str) -> int:
    """Nodes with an accepted submission (``echorl status --bootstrap``); 0 without a swarm."""
    if not addr:
        return 0
    cmd = [sys.executable, "-m", "echorl.cli", "status", "--bootstrap", addr, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"echorl status failed: {out.stderr[-2000:]}")
    return sum(p["submissions_accepted"] > 0 for p in json.loads(out.stdout)["peers"])


def sampled(url: str, key: str) -> tuple[int, int]:
    """A key's tokens sampled and, of those, by nodes (its sessions' usage)."""
    import httpx

    rows = httpx.get(url + "/api/v1/echorl/usage", headers={"X-API-Key": key}, timeout=30).json()["sessions"]
    return sum(r["tokens_sampled"] for r in rows), sum(r["tokens_sampled_by_nodes"] for r in rows)


def run_client(url: str, key: str, client: str, venv: Path, args: list[str], base_model: str) -> dict:
    prefix = "LOGITS" if client == "logits" else "TINKER"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({f"{prefix}_BASE_URL": url, f"{prefix}_API_KEY": key, "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"})
    env.update(ECHORL_UNSEEDED="1", ECHORL_BASE_MODEL=base_model)
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


def sample_rate(raw: Raw, sampler: str, n: int, seed: int | None) -> float:
    """Tokens/s of ``n`` requests of 8 x 16 tokens sent at once (``seed``: the server samples them)."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [20, 21, 22, 23]}]}
    params = {"max_tokens": 16, "temperature": 1.0, "seed": seed}
    t0 = time.perf_counter()
    futs = [
        raw.post(
            "/api/v1/asample",
            {
                "sampling_session_id": sampler,
                "seq_id": i,
                "num_samples": 8,
                "prompt": prompt,
                "sampling_params": params,
            },
        )
        for i in range(n)
    ]
    tokens = sum(len(s["tokens"]) for f in futs for s in raw.result(f)["sequences"])
    return round(tokens / (time.perf_counter() - t0), 1)


def measure_http(url: str, key: str, n_fwdbwd: int, n_samples: int, swarm: bool, model: Path, name: str) -> dict:
    import torch

    from echorl.service.engine import Engine
    from echorl.service.wire import Limits, fwdbwd_from_json

    torch.set_num_threads(1)
    raw = Raw(url, key)
    body = {"session_id": raw.session, "model_seq_id": 0, "base_model": name, "lora_config": {"rank": 8}}
    model_id = raw.result(raw.post("/api/v1/create_model", body))["model_id"]
    data = [_datum([20 + (i + j) % 40 for j in range(14)]) for i in range(8)]
    req = {"model_id": model_id, "forward_backward_input": {"data": data, "loss_fn": "cross_entropy"}}
    engine = Engine(model)
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
    body = {"session_id": raw.session, "model_seq_id": 1, "base_model": name}
    swarm_model = raw.result(raw.post("/api/v1/create_model", {**body, "lora_config": {"rank": SWARM_RANK}}))
    sampler = raw.result(raw.post("/api/v1/save_weights_for_sampler", {"model_id": swarm_model["model_id"]}))
    swarm_rate = sample_rate(raw, sampler["sampling_session_id"], n_samples, seed=None) if swarm else None
    learner_rate = sample_rate(raw, sampler["sampling_session_id"], n_samples, seed=1)
    return {
        "learner_tokens_per_s": learner_rate,
        "swarm_tokens_per_s": swarm_rate,
        "fwdbwd_requests": n_fwdbwd,
        "http_fwdbwd_p50_ms": round(pct(http_ms, 0.5), 2),
        "http_fwdbwd_p99_ms": round(pct(http_ms, 0.99), 2),
        "bare_fwdbwd_p50_ms": round(pct(bare_ms, 0.5), 2),
        "bare_fwdbwd_p99_ms": round(pct(bare_ms, 0.99), 2),
        "http_overhead_p50_ms": round(pct(http_ms, 0.5) - pct(bare_ms, 0.5), 2),
        "http_overhead_p99_ms": round(pct(http_ms, 0.99) - pct(bare_ms, 0.99), 2),
        "http_overhead_mean_ms": round(statistics.fmean(h - b for h, b in zip(http_ms, bare_ms)), 2),
    }


def loop_command(client: str, loop: str, model: Path, log_dir: Path, args: argparse.Namespace) -> list[str]:
    """The client script of a loop (tests/service/clients) with its arguments."""
    if loop == "supervised":
        return ["supervised.py", client, str(args.sup_steps)]
    if client == "tinker":
        return ["cookbook_rl.py", str(model), str(log_dir), str(args.rl_steps), str(RL_LR)]
    return ["rl_plain.py", client, str(model), str(args.rl_steps), str(RL_LR)]


def measured_loop(url: str, key: str, client: str, venv: Path, cmd: list[str], name: str, addr: str, loop: str) -> dict:
    """One loop's line: its figures, the nodes that served the swarm so far, and the share of the
    key's sampled tokens during the loop that nodes sampled (None: it sampled nothing)."""
    before = sampled(url, key)
    out = run_client(url, key, client, venv, cmd, name)
    (tokens, by_nodes), share = sampled(url, key), None
    if tokens > before[0]:
        share = round((by_nodes - before[1]) / (tokens - before[0]), 3)
    return {"client": client, "loop": loop, **out, "nodes_sampling": nodes_sampling(addr), "node_token_share": share}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--sup-steps", type=int, default=8, help="supervised steps per client")
    p.add_argument("--rl-steps", type=int, default=10, help="RL batches (8 prompts x 8 samples) per client")
    p.add_argument("--fwdbwd", type=int, default=30, help="forward_backward requests timed, HTTP vs bare")
    p.add_argument("--samples", type=int, default=10, help="sample requests (8 x 16 tokens) timed")
    p.add_argument("--model", default="", help="a local Hugging Face model directory (default: the shipped tiny model)")
    p.add_argument("--swarm-wait-s", type=float, default=30.0, help="the server's --swarm-wait-s")
    p.add_argument("--prompts-per-lease", type=int, default=8, help="the server's --prompts-per-lease")
    p.add_argument("--nodes", type=int, default=2, help="echorl node processes sampling for the server (0: no swarm)")
    p.add_argument("--clients", default="tinker,logits", help="which clients to run (comma-separated)")
    p.add_argument("--together", action="store_true", help="then both clients' RL loops at once (two users, one swarm)")
    p.add_argument("--venvs", default=str(ROOT), help="folder holding .venv-tinker and .venv-logits")
    args = p.parse_args()
    from echorl.actor.model import default_model

    keys = {user: f"tml-{secrets.token_hex(16)}" for user in ("tinker", "logits")}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        procs, url, addr, name = start_server(
            tmp, keys, args.nodes, args.model, args.swarm_wait_s, args.prompts_per_lease
        )
        model = Path(args.model) if args.model else default_model()
        try:
            clients = [c for c in args.clients.split(",") if c]
            for client in clients:
                venv = Path(args.venvs) / f".venv-{client}"
                if not (venv / ".installed").exists():
                    emit({"client": client, "skipped": f"{venv} absent (make clients)"}, args.json)
                    continue
                for loop in ("supervised", "rl"):
                    cmd = loop_command(client, loop, model, tmp / f"{client}-{loop}", args)
                    emit(measured_loop(url, keys[client], client, venv, cmd, name, addr, loop), args.json)
            if args.together and len(clients) > 1:  # two users' RL loops on one swarm at once
                with ThreadPoolExecutor(len(clients)) as pool:
                    runs = [
                        pool.submit(
                            measured_loop,
                            url,
                            keys[c],
                            c,
                            Path(args.venvs) / f".venv-{c}",
                            loop_command(c, "rl", model, tmp / f"{c}-together", args),
                            name,
                            addr,
                            "rl_together",
                        )
                        for c in clients
                    ]
                    for run in runs:
                        emit(run.result(), args.json)
            figures = measure_http(url, keys["tinker"], args.fwdbwd, args.samples, bool(addr), model, name)
            emit({"bench": "service", **figures, "loadavg": [round(x, 2) for x in os.getloadavg()]}, args.json)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
