"""Across a network lab (tests/netlab.py): every peer in its own namespace, uplinks capped by
``tc tbf``, some nodes behind an nftables NAT. Needs root, ``ip``, ``tc`` and ``nft``.

    python bench/netlab.py --nodes 8 --nat 4 --uplink-mbps 20 --size-mb 8 --json
    python bench/netlab.py --train --nodes 6 --nat 3 --steps 200 --json

Broadcast mode: the learner's ``Broadcaster`` runs in the learner namespace (this script
re-executed there), the nodes are ``broadcast/relay_process.py`` peers in theirs (NAT'd ones
reported unreachable: leaves); a first version dials every edge, the second is timed. Prints
tree_seconds, lower_bound_seconds (W/B: one copy at the learner's uplink), topology_bound_seconds
(W/B × the copies the plan's busiest node uploads; NAT'd nodes relay by pushing to reachable
children, ``broadcast/push.py``), nodes_received,
nat_nodes_received and learner_upload_copies (bytes leaving the learner's interface during the
timed version, TCP/Noise overhead included, / W). Targets: all receive, tree ≤ 1.3 × bound,
copies ≤ 1.25. ``--compare`` also times a version with NAT'd nodes as plain leaves (the
``*_nat_leaves`` keys: the baseline, same run). ``--uplink-max-mbps M``: each node's cap drawn
log-uniformly in [``--uplink-mbps``, M] (``--seed``), the learner's M, each node paced at the same
fraction of its own cap, and the lower bound max(W/B_learner, N·W/(B_learner + Σ uᵢ));
The timed version is planned as ``echorl learner`` plans by default, without uplink weights;
``--plan-weights`` plans it with the weights measured over the versions before it (``echorl
learner --plan-weights``), and ``--compare-weights`` first times a version planned without them
(the ``*_unweighted`` keys), then one with them (issue 27).

Train mode: ``echorl learner`` and ``echorl node`` processes; prints eval_reward_start,
eval_reward_end (the learner's held-out evaluation), nodes_contributing and
nat_nodes_contributing (nodes whose RunEnded summary counts accepted rollout groups).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _report import emit  # noqa: E402

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


# --- the learner side, run inside the learner namespace ---------------------------------------
def broadcaster_main(args: argparse.Namespace) -> None:
    """Serve a Broadcaster; read the nodes (one JSON list on stdin); publish two versions;
    print one JSON result line."""
    import trio
    from broadcast import fake_safetensors  # bench/broadcast.py (bench/ is first on sys.path)

    from echorl.broadcast.broadcaster import Broadcaster, NodeInfo
    from echorl.net.host import HostConfig, open_host
    from echorl.protocol.identity import Identity

    def tx_bytes() -> int:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())

    if os.environ.get("ECHORL_RELAY_LOG", "").lower() == "info":  # whom the learner adopted, as the relays log
        logging.basicConfig(level="INFO", stream=sys.stderr)

    async def main() -> None:
        identity = Identity.generate()
        size = int(args.size_mb * 1024 * 1024)
        async with open_host(identity, HostConfig(listen="/ip4/0.0.0.0/tcp/4001")) as host:
            bc = Broadcaster(
                host,
                identity,
                "bench",
                fanout=args.fanout,
                chunk_bytes=int(args.chunk_kb * 1024) or None,
                full_every=1,
                done_timeout_s=args.timeout,
                direct=not args.no_direct,
                upload_limit=args.pace_mbps * 1e6 / 8 if args.pace_mbps else None,
            )
            bc.install()
            async with trio.open_nursery() as nursery:
                await nursery.start(bc.run)
                print(json.dumps({"event": "ready", "addr": host.addrs[0]}), flush=True)
                line = await trio.to_thread.run_sync(sys.stdin.readline)
                nodes = [NodeInfo(n["peer_id"], n["reachable"], tuple(n["addrs"])) for n in json.loads(line)]
                out: dict = {"event": "result"}
                # NAT'd nodes pushing to reachable children (the default), then as plain leaves;
                # with --compare-weights first planned without the weights the learner measures,
                # the timed version as the learner plans it: without weights unless --plan-weights
                weighted = args.plan_weights or args.compare_weights
                runs = [(True, False, "_unweighted")] if args.compare_weights else []
                runs += [(True, weighted, "")] + ([(False, weighted, "_nat_leaves")] if args.compare else [])
                for i, (nat_push, weigh, suffix) in enumerate(runs):
                    warm, timed = 2 * i + 1, 2 * i + 2
                    bc.nat_push, bc.weigh = nat_push, weigh
                    await bc.publish(warm, fake_safetensors(size, warm + 2), nodes)  # dials every edge
                    await trio.sleep(0.5)
                    data = fake_safetensors(size, timed)
                    before = tx_bytes()
                    print(json.dumps({"event": "publishing", "version": timed, "t0": time.time()}), flush=True)
                    samples: list[tuple[float, int]] = []
                    async with trio.open_nursery() as sampling:
                        sampling.start_soon(_sample_tx, tx_bytes, samples)
                        tree = await bc.publish(timed, data, nodes)
                        sampling.cancel_scope.cancel()
                    sent = tx_bytes() - before
                    # when the learner's own copy had left (99% of its bytes): the rest is the relays' tail
                    out[f"learner_send_seconds{suffix}"] = next(
                        t - samples[0][0] for t, n in samples if n - before >= 0.99 * sent
                    )
                    plan = bc._plans[timed]
                    weights = {m.peer_id: m.weight for m in bc.server.states[timed].announce.members}
                    out.update(
                        {
                            f"tree_seconds{suffix}": tree.seconds,
                            f"completed{suffix}": tree.completed,
                            f"depth{suffix}": tree.depth,
                            f"chunk_bytes{suffix}": bc.server.states[timed].manifest.chunk_bytes,
                            f"learner_tx_bytes{suffix}": sent,
                            f"busiest_node_copies{suffix}": max(plan.upload_copies(n.peer_id) for n in nodes),
                            f"copies{suffix}": [round(plan.upload_copies(n.peer_id), 2) for n in nodes],
                            f"weights{suffix}": [weights.get(n.peer_id) for n in nodes],
                        }
                    )
                out.update({"bytes": len(data)})
                print(json.dumps(out), flush=True)
                nursery.cancel_scope.cancel()

    trio.run(main)


async def _sample_tx(tx_bytes, samples: list[tuple[float, int]]) -> None:
    import trio

    while True:
        samples.append((time.monotonic(), tx_bytes()))
        await trio.sleep(0.01)


# --- the parent side, in the root namespace ---------------------------------------------------
def broadcaster_argv(args: argparse.Namespace) -> list[str]:
    """This script as the learner-side broadcaster (``broadcaster_main``) with ``args``' settings."""
    return [
        sys.executable,
        str(Path(__file__).resolve()),
        "--_broadcaster",
        "--size-mb",
        str(args.size_mb),
        "--fanout",
        str(args.fanout),
        "--chunk-kb",
        str(args.chunk_kb),
        "--timeout",
        str(args.timeout),
        *(["--no-direct"] if args.no_direct else []),
        "--pace-mbps",
        str(args.pace_mbps),
        *(["--compare"] if getattr(args, "compare", False) else []),
        *(["--compare-weights"] if getattr(args, "compare_weights", False) else []),
        *(["--plan-weights"] if getattr(args, "plan_weights", False) else []),
    ]


def relay_argv(learner_addr: str, no_direct: bool = False, pace_mbps: float = 0.0) -> list[str]:
    """A ``broadcast/relay_process.py`` node that dials the learner (as a joining node does)."""
    return [
        sys.executable,
        "-m",
        "echorl.broadcast.relay_process",
        "--learner",
        learner_addr,
        "--run-id",
        "bench",
        "--listen",
        "/ip4/0.0.0.0/tcp/0",
        "--stall-s",
        "30",
        "--dial-learner",
        "--upload-mbps",
        str(pace_mbps),
        *(["--no-direct"] if no_direct else []),
    ]


def _json_line(proc: subprocess.Popen, event: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    for line in proc.stdout:  # type: ignore[union-attr]
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if obj.get("event") == event:
            return obj
        if time.monotonic() > deadline:
            break
    raise RuntimeError(f"no {event!r} line from {proc.args}")


def uplink_caps(args: argparse.Namespace) -> list[float]:
    """Each node's tbf cap (Mbit/s): all ``--uplink-mbps``, or log-uniform up to ``--uplink-max-mbps``."""
    import math
    import random

    lo, hi = args.uplink_mbps, max(args.uplink_mbps, args.uplink_max_mbps)
    rng = random.Random(args.seed)
    return [round(math.exp(rng.uniform(math.log(lo), math.log(hi))), 2) if hi > lo else lo for _ in range(args.nodes)]


def run_broadcast(lab, args: argparse.Namespace) -> dict:
    caps = uplink_caps(args)
    learner_cap = max(args.uplink_mbps, args.uplink_max_mbps)
    learner = lab.add_peer("learner", uplink_mbps=learner_cap)
    peers = [
        lab.add_peer(f"nat-{i}", nat=True, uplink_mbps=caps[i])
        if i < args.nat
        else lab.add_peer(f"pub-{i}", uplink_mbps=caps[i])
        for i in range(args.nodes)
    ]
    pace = args.pace_mbps / args.uplink_mbps  # each peer paced at this fraction of its own cap
    learner_args = argparse.Namespace(**{**vars(args), "pace_mbps": round(pace * learner_cap, 3)})
    bc = subprocess.Popen(
        learner.cmd(*broadcaster_argv(learner_args)), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV
    )
    learner.procs.append(bc)
    addr = _json_line(bc, "ready", 120)["addr"]
    relays = []
    for p, cap in zip(peers, caps):
        proc = subprocess.Popen(
            p.cmd(*relay_argv(addr, args.no_direct, round(pace * cap, 3))),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=ENV,
        )
        p.procs.append(proc)
        relays.append((p, proc))
    nodes = []
    for p, proc in relays:
        ready = _json_line(proc, "ready", 120)
        nodes.append({"peer_id": ready["peer_id"], "addrs": ready["addrs"], "reachable": not p.nat})
    bc.stdin.write(json.dumps(nodes) + "\n")  # type: ignore[union-attr]
    bc.stdin.flush()  # type: ignore[union-attr]
    t0 = _json_line(bc, "publishing", args.timeout + 60)["t0"]
    res = _json_line(bc, "result", args.timeout * 2 + 60)
    receiver_seconds = sorted(_version_time(proc, t0) for _, proc in relays)
    nat_ids = {n["peer_id"] for n, (p, _) in zip(nodes, relays) if p.nat}
    learner_rate = learner_cap * 1e6 / 8
    total = learner_rate + sum(c * 1e6 / 8 for c in caps)
    bound = max(res["bytes"] / learner_rate, args.nodes * res["bytes"] / total)  # Kumar & Ross
    for _, proc in relays:
        proc.stdin.close()  # type: ignore[union-attr]
    out = {
        "nodes": args.nodes,
        "nat_nodes": args.nat,
        "uplink_mbps": args.uplink_mbps,
        "uplinks_mbps": caps,
        "bytes": res["bytes"],
        "fanout": args.fanout,
        "chunk_kb": res["chunk_bytes"] / 1024,
        "pace_mbps": args.pace_mbps,
        "load_average_1m": os.getloadavg()[0],
    }
    suffixes = ("_unweighted",) * args.compare_weights + ("",) + ("_nat_leaves",) * args.compare
    for suffix in suffixes:
        tree = res[f"tree_seconds{suffix}"]
        out.update(
            {
                f"depth{suffix}": res[f"depth{suffix}"],
                f"tree_seconds{suffix}": round(tree, 3),
                f"tree_over_lower_bound{suffix}": round(tree / bound, 3),
                # the plan's busiest node uploads this many copies at its own uplink
                f"topology_bound_seconds{suffix}": round(
                    max(
                        res["bytes"] / learner_rate,
                        *(res["bytes"] * c / (u * 1e6 / 8) for c, u in zip(res[f"copies{suffix}"], caps)),
                    ),
                    3,
                ),
                f"copies{suffix}": res[f"copies{suffix}"],
                f"weights{suffix}": res[f"weights{suffix}"],
                f"nodes_received{suffix}": len(res[f"completed{suffix}"]),
                f"nat_nodes_received{suffix}": len(nat_ids & set(res[f"completed{suffix}"])),
                f"learner_upload_copies{suffix}": round(res[f"learner_tx_bytes{suffix}"] / res["bytes"], 3),
                f"learner_send_seconds{suffix}": round(res[f"learner_send_seconds{suffix}"], 3),
            }
        )
    out["lower_bound_seconds"] = round(bound, 3)
    # when each node held the (first) timed version, from the learner's start: the spread shows
    # whether one slow stripe or a uniformly slow pipeline sets tree_seconds
    out["receiver_seconds"] = [round(s, 3) for s in receiver_seconds]
    out["uplink_drops"] = sum(_tbf_drops(p) for p in [learner, *peers])
    return out


def _version_time(proc: subprocess.Popen, t0: float) -> float:
    """Seconds from ``t0`` until the relay printed the version published at ``t0`` (its 2nd)."""
    seen = 0
    while True:
        event = _json_line(proc, "version", 60)
        seen += 1
        if seen == 2:
            return event["t"] - t0


def _tbf_drops(peer) -> int:
    """Packets the peer's uplink shaper dropped (its queue overflowed) since the lab was built."""
    out = subprocess.run(peer.cmd("tc", "-s", "qdisc", "show", "dev", "eth0"), capture_output=True, text=True)
    found = re.search(r"dropped (\d+)", out.stdout)
    return int(found.group(1)) if found else 0


def _eval_rewards(metrics: Path) -> list[float]:
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    return [r["eval_reward"] for r in rows if r.get("eval_reward") is not None]


def run_train(lab, args: argparse.Namespace, tmp: Path) -> dict:
    learner = lab.add_peer("learner")
    peers = [
        lab.add_peer(f"nat-{i}", nat=True) if i < args.nat else lab.add_peer(f"pub-{i}") for i in range(args.nodes)
    ]
    addr_file, metrics = tmp / "addr", tmp / "m.jsonl"
    cli = [sys.executable, "-m", "echorl.cli"]
    lp = lab.spawn(
        learner,
        [
            *cli,
            "learner",
            "--listen",
            "/ip4/0.0.0.0/tcp/4001",
            "--addr-file",
            str(addr_file),
            "--metrics-out",
            str(metrics),
            "--steps",
            str(args.steps),
            "--staleness",
            "4",
            "--eval-every",
            str(max(1, args.steps // 4)),
        ],
        tmp / "learner.log",
        env=ENV,
    )
    deadline = time.monotonic() + 180
    while not addr_file.exists():
        if lp.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("learner did not start:\n" + (tmp / "learner.log").read_text()[-3000:])
        time.sleep(0.2)
    addr = addr_file.read_text().strip()
    procs = [
        lab.spawn(
            p,
            [
                *cli,
                "node",
                "--bootstrap",
                addr,
                "--key",
                str(tmp / f"{p.name}.key"),
                "--listen",
                "/ip4/0.0.0.0/tcp/0",
                "--seed",
                str(i),
            ],
            tmp / f"{p.name}.log",
            env=ENV,
        )
        for i, p in enumerate(peers)
    ]
    lp.wait(timeout=args.timeout)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    contributed = {}
    for p in peers:
        m = re.search(r"contributed (\d+) leases, (\d+) rollout groups", (tmp / f"{p.name}.log").read_text())
        contributed[p.name] = bool(m and int(m.group(2)) > 0)
    rewards = _eval_rewards(metrics)
    return {
        "nodes": args.nodes,
        "nat_nodes": args.nat,
        "steps": args.steps,
        "uplink_mbps": args.uplink_mbps,
        "eval_reward_start": rewards[0] if rewards else None,
        "eval_reward_end": rewards[-1] if rewards else None,
        "nodes_contributing": sum(contributed.values()),
        "nat_nodes_contributing": sum(v for k, v in contributed.items() if k.startswith("nat-")),
    }


def _lab_module() -> tuple:
    """tests/netlab.py (its name is this script's): loaded under another module name."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("echorl_netlab", ROOT / "tests" / "netlab.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["echorl_netlab"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.Lab, module.unavailable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--nat", type=int, default=4, help="how many of the nodes are behind the NAT")
    ap.add_argument("--uplink-mbps", type=float, default=20.0, help="tbf cap of every peer's uplink")
    ap.add_argument("--size-mb", type=float, default=8.0)
    ap.add_argument("--fanout", type=int, default=4)
    ap.add_argument(
        "--chunk-kb",
        type=float,
        default=0.0,
        help="chunk size (0: the learner's default, auto_chunk_bytes from the size and the nodes)",
    )
    ap.add_argument("--no-direct", action="store_true", help="chunks over libp2p streams only (no direct TCP)")
    ap.add_argument(
        "--pace-mbps",
        type=float,
        default=None,
        help="every peer's --upload-mbps (default: 0.95 × --uplink-mbps, as docs/network-notes.md "
        "tells a volunteer to set it; 0: none, the link alone limits)",
    )
    ap.add_argument(
        "--no-baseline", action="store_true", help="broadcast mode: skip the same run unpaced (the *_unpaced keys)"
    )
    ap.add_argument(
        "--compare",
        action="store_true",
        help="also time a version with NAT'd nodes as plain leaves (the *_nat_leaves keys)",
    )
    ap.add_argument(
        "--uplink-max-mbps", type=float, default=0.0, help="nodes' caps log-uniform up to this (the learner's)"
    )
    ap.add_argument("--seed", type=int, default=0, help="draws the nodes' caps")
    ap.add_argument(
        "--plan-weights",
        action="store_true",
        help="plan the timed version with the uplink weights measured over the versions before it, as "
        "`echorl learner --plan-weights` does (default: without, the learner's default; on equal caps "
        "the measured weights differ by a quantum or two and the plan then gives a node 1.25 copies)",
    )
    ap.add_argument(
        "--compare-weights",
        action="store_true",
        help="first time a version planned without uplink weights (the *_unweighted keys)",
    )
    ap.add_argument("--train", action="store_true", help="train with echorl learner/node processes instead")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--logs", help="train mode: keep the learner's and nodes' logs (and metrics) in this folder")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--_broadcaster", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._broadcaster:
        broadcaster_main(args)
        return
    Lab, unavailable = _lab_module()
    why = unavailable()
    if why:
        sys.exit(f"bench/netlab.py: network lab unavailable: {why}")
    if args.pace_mbps is None:
        args.pace_mbps = 0.0 if args.train else round(0.95 * args.uplink_mbps, 3)
    with Lab(uplink_mbps=args.uplink_mbps) as lab, tempfile.TemporaryDirectory(prefix="netlab-") as tmp:
        where = Path(args.logs or tmp)
        where.mkdir(parents=True, exist_ok=True)
        out = run_train(lab, args, where) if args.train else run_broadcast(lab, args)
    if not args.train and args.pace_mbps and not args.no_baseline:
        # the same broadcast with nothing paced, in a fresh lab: the uplinks' queues fill up
        unpaced = argparse.Namespace(**{**vars(args), "pace_mbps": 0.0})
        with Lab(uplink_mbps=args.uplink_mbps) as lab:
            base = run_broadcast(lab, unpaced)
        out.update(
            {
                f"{k}_unpaced": base[k]
                for k in (
                    "tree_seconds",
                    "tree_over_lower_bound",
                    "nodes_received",
                    "learner_send_seconds",
                    "receiver_seconds",
                    "uplink_drops",
                )
            }
        )
    emit(out, args.json)


if __name__ == "__main__":
    main()
