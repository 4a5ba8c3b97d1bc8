"""The learner's control plane with many volunteers: N light peers against one real learner.

    python bench/swarm.py --peers 100,300 --json            # N=10 (the baseline) runs first
    python bench/swarm.py --peers 1000 --window 30 --work-s 10 --json

One real learner process (``echorl learner`` as ``tests/swarm.py`` starts it, the tiny default
model) and ``ceil(N / --per-process)`` worker processes (this script with ``--worker``), each a
trio run holding up to ``--per-process`` peers. Every peer is a real libp2p host (its own Ed25519
identity, TCP + Noise + yamux) listening on and dialling from its own loopback address
(127.0.0.2, 127.0.0.3, ... across 127.0.0.0/8), so the learner sees N hosts, not one: its
per-address caps (joins, leases, connections per address) stay out of the way as they would for
N machines. Each peer joins (a signed ``JoinRequest``), then loops: lease (``LeaseRequest``;
deferrals are followed as a node follows them), a fixed-cost stand-in for generation (``--work-s``
seconds of sleep, ±20 % jitter so the peers do not march in step), a signed ``Submit`` of the
leased prompts (``tests/swarm.py: signed_submit``, varied samples so a group is not all
duplicates). The learner pings every peer it has not heard from for ``liveness_after_s`` (3 s):
the peers' hosts answer those pings (libp2p ping), so the bench carries the learner's liveness
sweep too.

Exercised: connection admission (guard), Noise handshakes, join (signature, capability, roster),
lease allotment and deferral, submission decoding, signature and checks (bounds, tokens, log-probs,
the batch share), the buffer, receipts, the liveness pings, a paged ``Status`` read.
Not exercised (said, not hidden): generation (a sleep stands in), spot checks and seeded sampling
proofs (``spot_check_fraction`` 0, ``--no-sampling-proofs``: a spot check reruns the model, which
is compute and not control plane; fabricated samples would fail it), training steps and
publication (``prompts_per_step`` is larger than what a window submits, so no step is taken and no
plan is built or announced: ``plan_build_s`` and ``announce_bytes`` are not measured here).

Per N, one JSON line: ``peers``, ``joined``, ``join_s`` (all joins), ``leases_per_s``,
``deferrals_per_s`` (and ``deferrals_by_reason``: ``LeaseDeferred.reason`` counts in the window),
``submits_per_s`` (accepted), ``lease_p50_ms``, ``lease_p99_ms``, ``submit_p50_ms``,
``submit_p99_ms``, ``peer_loop_lag_p50_ms`` and ``_p99_ms`` (how late the worker processes' own
loops woke: lease latency is timed in them, so their lag is in it), ``learner_loop_lag_p50_ms``,
``_p99_ms``, ``_max_ms`` (the learner's own, from its status: the last minute), ``cpu_ms_per_submission`` (the
learner process's user+system CPU over the window, from /proc, per accepted submission),
``learner_cpu_share`` (of one core),
``cpu_ms_per_submission_net`` (the same, less the learner's CPU with no peer joined,
``learner_idle_cpu_share``, measured for ``--idle-s`` before the peers start: at N=10 the fixed
background is most of the figure), ``learner_rss_mb``, ``status_ms`` (every page of a ``Status``
read), ``peers_cpu_share``, ``errors`` (by kind), ``learner_said`` (learner log lines over the run:
``peers_lost`` after a failed ping, ``peers_struck``), ``learner_exited`` (its exit code if it died
during the run, with its last error line on stderr; null: running), and, from the N=10 run of the same invocation,
``*_vs_10`` ratios. ``loadavg`` is recorded: the
2-core machine is shared (the peers' own processes run on the same cores as the learner, unless
``--learner-core C`` gives the learner core C and the peers the others, as a learner's own machine
would).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the process swarm and the hostile doubles' join

from _loopback import bind_dials, listen_on, loopback  # noqa: E402 - bench/ is on sys.path when run as a script
from _report import emit  # noqa: E402
from hostile import RUN, join  # noqa: E402
from swarm import Swarm, signed_submit  # noqa: E402

from echorl.common import gc_pauses  # noqa: E402
from echorl.net.host import HostConfig, PeerUnavailable, RemoteError, open_host  # noqa: E402
from echorl.protocol import routes  # noqa: E402
from echorl.protocol.identity import Identity  # noqa: E402
from echorl.protocol.messages import Lease, LeaseDeferred, LeaseRequest, Status, StatusRequest  # noqa: E402

#: the learner's settings: no spot checks or seeded proofs (compute, not control plane), a batch no
#: window fills (no training step, no publication), small leases and groups (decode cost per message
#: stays a control-plane figure), no DHT (the peers bootstrap from the learner)
LEARNER = {
    "eval_every": 10**9,
    "steps": 0,
    "checkpoint_dir": "none",
    "spot_check_fraction": 0.0,
    "sampling_proofs": False,
    "dht": False,
    "prompts_per_step": 100_000,
    "prompts_per_lease": 2,
    "group_size": 2,
    "staleness": 2,
}
JITTER = 0.2  # ± share of --work-s per lease, so N peers do not submit in lockstep


# --- worker process: many peers in one trio run ------------------------------------------------
async def one_peer(i: int, args: argparse.Namespace, events: list, joined: list, stop: trio.Event) -> None:
    me, ip = Identity.generate(), loopback(i)
    rng = random.Random(i)
    try:
        async with open_host(me, HostConfig(listen=listen_on(ip))) as host:
            bind_dials(host, ip)
            while True:  # as a node does: a join that failed (a handshake or dial-back deadline) is retried
                try:
                    await host.connect(args.addr)
                    await join(host, args.learner, me)
                    break
                except Exception as exc:
                    events.append(("join_error:" + why(exc), time.time(), 0.0))
                    await trio.sleep(1.0 + rng.random())
            joined.append(i)
            version = 2**40
            while not stop.is_set():
                t = time.perf_counter()
                try:
                    req = LeaseRequest(run_id=RUN, version=version, max_prompts=LEARNER["prompts_per_lease"])
                    reply = await host.request(args.learner, routes.LEASE, req, expect=(Lease, LeaseDeferred))
                except Exception as exc:  # counted, then retried
                    events.append(("lease_error:" + why(exc), time.time(), 0.0))
                    await trio.sleep(1.0)
                    continue
                lat = time.perf_counter() - t
                if isinstance(reply, LeaseDeferred):
                    events.append(("deferred:" + reply.reason, time.time(), lat))
                    version = reply.want_version if reply.want_version >= 0 else version
                    await trio.sleep(max(0.05, reply.retry_after_s))  # earlier is refused, then struck
                    continue
                events.append(("lease", time.time(), lat))
                await trio.sleep(args.work_s * (1 + JITTER * (2 * rng.random() - 1)))  # the stand-in
                msg = signed_submit(me, reply, version, vary=True)
                t = time.perf_counter()
                try:
                    await host.request(args.learner, routes.SUBMIT, msg)
                    events.append(("submit", time.time(), time.perf_counter() - t))
                except Exception as exc:
                    events.append(("submit_error:" + why(exc), time.time(), 0.0))
    except Exception as exc:
        events.append(("peer_error:" + why(exc), time.time(), 0.0))


def why(exc: Exception) -> str:
    """An error's kind for the counts: the learner's refusal code, else the exception's type; a
    PeerUnavailable also says where it failed (``open``: no stream could be opened, with the
    cause's type; ``no_reply``: the deadline; else the stream error's type)."""
    if isinstance(exc, RemoteError):
        return exc.code.value
    if isinstance(exc, PeerUnavailable):
        text = str(exc)
        cause = text.split(": ")[1].split(":")[0].split(" ")[0] if ": " in text else "?"
        where = "open:" if text.startswith("open ") else ""
        return f"{type(exc).__name__}({where}{'no_reply' if 'no reply within' in text else cause})"
    return type(exc).__name__


LAG_TICK_S = 0.02
"""The worker's loop-lag probe sleeps this long and records how much later it woke: a lease's
latency measured in a worker includes that worker's own lag, which the figure must not charge to
the learner."""


async def loop_lag(events: list, stop: trio.Event) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await trio.sleep(LAG_TICK_S)
        events.append(("lag", time.time(), time.perf_counter() - t - LAG_TICK_S))


async def worker(args: argparse.Namespace) -> None:
    events: list = []
    joined: list = []
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(loop_lag, events, stop)
        for i in range(args.first, args.first + args.count):
            nursery.start_soon(one_peer, i, args, events, joined, stop)
            await trio.sleep(args.stagger_s)  # spread the handshakes
        with trio.move_on_after(args.join_timeout):
            while len(joined) < args.count:
                await trio.sleep(0.2)
        gc_pauses.after_start_up()  # as a node does once started: its hosts out of full collections' reach
        print(json.dumps({"joined": len(joined)}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)  # until the parent closes it
        stop.set()
        nursery.cancel_scope.cancel()
    print(json.dumps({"events": events}), flush=True)


# --- the parent: one learner, the workers, the figures -----------------------------------------
def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit it; one that ended
    since the listing is skipped)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:
            pass


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def read_status(addr: str, learner: str) -> tuple[float, int, dict]:
    """Seconds to read every page of the learner's Status, the peers it lists, and the learner's
    own figures (its first page's ``learner`` table)."""
    async with open_host(Identity.generate()) as host:
        await host.connect(addr)
        t, cursor, peers, figures = time.perf_counter(), 0, 0, {}
        while cursor is not None:
            st = await host.request(learner, routes.STATUS, StatusRequest(cursor=cursor), expect=Status)
            peers += len(st.peers)
            figures = figures or dict(st.learner)
            cursor = st.next_cursor
        return time.perf_counter() - t, peers, figures


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


LEARNER_SAID = {"peers_lost": "unresponsive (", "peers_struck": "struck off"}
"""Learner log lines counted over the whole run (the bench trains no step, so it writes no metrics
row): members it marked dead after a failed ping, identities it struck off."""


def run_one(n: int, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="echorl-swarm-") as d:
        tmp = Path(d)
        (tmp / "learner.json").write_text(json.dumps(LEARNER))
        swarm = Swarm(tmp)
        workers: list[subprocess.Popen] = []
        try:
            addr = swarm.start_learner("--config", str(tmp / "learner.json"))
            if args.learner_core is not None:
                pin(swarm.learner.pid, {args.learner_core})
            learner = addr.rsplit("/p2p/", 1)[1]
            time.sleep(args.settle_s)  # start-up work done, then the learner's CPU with no peer: its background
            idle_t, idle0 = time.monotonic(), proc_cpu_s(swarm.learner.pid)
            time.sleep(args.idle_s)
            idle_share = (proc_cpu_s(swarm.learner.pid) - idle0) / (time.monotonic() - idle_t)
            t_join = time.monotonic()
            for first in range(0, n, args.per_process):
                cmd = [sys.executable, __file__, "--worker", "--addr", addr, "--learner", learner]
                cmd += ["--first", str(first), "--count", str(min(args.per_process, n - first))]
                cmd += ["--work-s", str(args.work_s), "--join-timeout", str(args.join_timeout)]
                cmd += ["--stagger-s", str(args.stagger_s)]
                workers.append(
                    subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=swarm_env())
                )
                if args.learner_core is not None:  # the peers on every other core
                    pin(workers[-1].pid, os.sched_getaffinity(0) - {args.learner_core})
            joined = sum(json.loads(w.stdout.readline() or '{"joined": 0}')["joined"] for w in workers)
            join_s = time.monotonic() - t_join
            say = f"swarm: {joined}/{n} joined in {join_s:.1f} s; measuring {args.window:g} s"
            print(say, file=sys.stderr, flush=True)
            time.sleep(args.warmup)
            pid = swarm.learner.pid
            t0, cpu0, load0 = time.time(), proc_cpu_s(pid), os.getloadavg()
            peers_cpu0 = sum(proc_cpu_s(w.pid) for w in workers)
            time.sleep(args.window)
            t1, cpu1 = time.time(), proc_cpu_s(pid)
            peers_cpu = sum(proc_cpu_s(w.pid) for w in workers) - peers_cpu0
            rss = proc_rss_mb(pid)
            try:  # a dial under a starved learner can miss its deadline: said, not fatal
                status_s, status_peers, figures = trio.run(read_status, addr, learner)
            except Exception as exc:
                status_s, status_peers, figures = float("nan"), -1, {}
                while isinstance(exc, BaseExceptionGroup) and exc.exceptions:  # trio's nurseries wrap it
                    exc = exc.exceptions[0]
                print(f"swarm: status read failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            said = swarm.learner_log.read_text(errors="replace")
            learner_said = {k: said.count(pat) for k, pat in LEARNER_SAID.items()}
            exited = swarm.learner.poll()  # a learner that died mid-run is named, not inferred
            if exited is not None:
                lines = [line.strip(" |+-") for line in said.splitlines()]  # a traceback's group borders
                errs = [x for x in lines if "Error" in x or "Exception" in x] if exited else []
                last = errs[-1:] or [x for x in lines if x][-1:] or ["(no log)"]
                say = f"swarm: the learner exited (code {exited}): {last[0]}"
                print(say, file=sys.stderr, flush=True)
            events: list = []
            for w in workers:
                w.stdin.close()
            for w in workers:
                for line in w.stdout:
                    if line.startswith('{"events"'):
                        events += json.loads(line)["events"]
                w.wait(timeout=60)
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
            swarm.stop()
    if args.events_out:  # the timeline behind the percentiles: one line per event, the window's bounds first
        with open(f"{args.events_out}.{n}.jsonl", "w") as f:
            f.write(json.dumps({"window": [t0, t1]}) + "\n")
            f.writelines(json.dumps({"kind": k, "t": t, "latency_s": lat}) + "\n" for k, t, lat in events)
    inside = [(k, lat) for k, t, lat in events if t0 <= t <= t1]
    lease = [lat for k, lat in inside if k == "lease"]
    lag = [lat for k, lat in inside if k == "lag"]
    submit = [lat for k, lat in inside if k == "submit"]
    window = t1 - t0
    errors = Counter(k for k, _ in inside if "error" in k)
    ms = 1e3
    return {
        "bench": "swarm",
        "peers": n,
        "joined": joined,
        "join_s": round(join_s, 2),
        "window_s": round(window, 1),
        "work_s": args.work_s,
        "leases_per_s": round(len(lease) / window, 2),
        "deferrals_per_s": round(sum(k.startswith("deferred:") for k, _ in inside) / window, 2),
        "deferrals_by_reason": dict(Counter(k.split(":", 1)[1] for k, _ in inside if k.startswith("deferred:"))),
        "submits_per_s": round(len(submit) / window, 2),
        "lease_p50_ms": round(pct(lease, 0.5) * ms, 2),
        "lease_p99_ms": round(pct(lease, 0.99) * ms, 2),
        "submit_p50_ms": round(pct(submit, 0.5) * ms, 2),
        "submit_p99_ms": round(pct(submit, 0.99) * ms, 2),
        # how late the workers' own loops woke (LAG_TICK_S probe): latency the learner did not cause
        "peer_loop_lag_p50_ms": round(pct(lag, 0.5) * ms, 2),
        "peer_loop_lag_p99_ms": round(pct(lag, 0.99) * ms, 2),
        # how late the learner's own loop woke (its status, the last minute): its part of the latency
        **{f"learner_{k}": figures.get(k) for k in ("loop_lag_p50_ms", "loop_lag_p99_ms", "loop_lag_max_ms")},
        "learner_core": args.learner_core,
        "cpu_ms_per_submission": round((cpu1 - cpu0) * ms / max(1, len(submit)), 3),
        # net of the learner's CPU with no peer at all (its timers, metrics rows): what the peers cost it
        "cpu_ms_per_submission_net": round(max(0.0, cpu1 - cpu0 - idle_share * window) * ms / max(1, len(submit)), 3),
        "learner_cpu_share": round((cpu1 - cpu0) / window, 3),
        "learner_idle_cpu_share": round(idle_share, 3),
        "peers_cpu_share": round(peers_cpu / window, 3),  # the worker processes, all together
        "worker_processes": len(workers),
        "learner_rss_mb": round(rss, 1),
        "status_ms": round(status_s * ms, 1),
        "status_peers": status_peers,
        "errors": dict(errors),
        "learner_said": learner_said,
        "learner_exited": exited,  # None: still running when the run was measured
        "loadavg": [round(x, 2) for x in load0],
    }


def swarm_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


RATIOS = (
    "lease_p50_ms",
    "lease_p99_ms",
    "submit_p99_ms",
    "cpu_ms_per_submission",
    "cpu_ms_per_submission_net",
    "learner_rss_mb",
    "status_ms",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", default="100", help="comma-separated N (N=10, the baseline, always runs first)")
    p.add_argument("--window", type=float, default=20.0, help="seconds measured per N, after every peer joined")
    p.add_argument("--settle-s", type=float, default=15.0, help="seconds after the learner starts before --idle-s")
    p.add_argument("--idle-s", type=float, default=5.0, help="seconds the learner's CPU is measured with no peer")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds after the joins before the window")
    p.add_argument("--work-s", type=float, default=5.0, help="the generation stand-in per lease (seconds)")
    p.add_argument("--per-process", type=int, default=50, help="peers per worker process")
    p.add_argument("--join-timeout", type=float, default=120.0)
    p.add_argument("--stagger-s", type=float, default=0.01, help="pause between starting two peers of a worker")
    p.add_argument(
        "--learner-core",
        type=int,
        default=None,
        help="pin the learner to this CPU and the peers' processes to the others (a learner does not share "
        "its machine with a thousand volunteers; default: all share every core)",
    )
    p.add_argument(
        "--events-out",
        default="",
        help="write every peer's events (kind, time, latency) to PATH.N.jsonl, the window's bounds first",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--addr", help=argparse.SUPPRESS)
    p.add_argument("--learner", help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        trio.run(worker, args)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # inherited by the learner and the workers
    sizes = [10] + [n for n in (int(x) for x in args.peers.split(",") if x) if n != 10]
    base: dict = {}
    for n in sizes:
        out = run_one(n, args)
        if n == 10:
            base = out
        for key in RATIOS:
            b = base.get(key)
            if b and not math.isnan(b) and n != 10:
                out[f"{key}_vs_10"] = round(out[key] / b, 2)
        emit(out, args.json)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
