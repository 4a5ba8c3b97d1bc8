"""echorl's broadcast side by side with Lattica and Shardcast, in the network lab (issue 11).

    python bench/versus.py --nodes 8 --size-mb 8 --uplink-mbps 20 --json
    python bench/versus.py --nodes 16 --size-mb 64 --uplink-mbps 20 --churn 0.25 --json

One run distributes the same payload (``fake_safetensors(size, 2)`` of bench/broadcast.py) from
one origin to N receivers with each system in turn, every peer in its own namespace of a fresh
lab (tests/netlab.py) with the same ``tc tbf`` uplink cap:

- ``echorl-direct`` / ``echorl-libp2p``: the striped pipelined broadcast (bench/netlab.py's
  broadcaster and ``echorl.broadcast.relay_process`` nodes), chunks over the direct TCP path or
  over libp2p streams only; a first version dials every edge, the second is timed.
- ``lattica``: Lattica 1.0.21: the origin ``put_block``s the payload, every receiver
  ``get_block``s every block (bitswap), ``--lattica`` block sizes / concurrency settings.
- ``shardcast``: Shardcast 0.3.2: origin → M middle nodes (receivers too) → the other
  receivers as clients of the middles, ``--shardcast`` tier sizes / shard sizes.
- ``one-to-many``: the origin sends every receiver its own copy at once (the floor).

Per system and setting one JSON line: system, setting, seconds (t0 → the last receiver holding a
copy whose SHA-256 matches), p50_seconds, origin_upload_bytes (tx of the origin's interface,
headers included), cpu_seconds (user+sys of every peer process and its children),
lower_bound_seconds (W/B), receivers_verified. ``--churn F``: ⌈F·N⌉ receivers (every 4th, from
the second) are SIGKILLed at t0 + W/B/2; seconds is then the last *surviving* receiver's time.
Anchors whose package is missing (the ``bench`` extra) are skipped with a reason line.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _report import emit  # noqa: E402
from netlab import ENV, _lab_module, broadcaster_argv, relay_argv  # noqa: E402

PEERS = [sys.executable, str(ROOT / "bench" / "versus_peers.py")]
PORT = 8000
SYSTEMS = ("echorl-direct", "echorl-libp2p", "lattica", "shardcast", "one-to-many")
NEEDS = {"lattica": "lattica", "shardcast": "shardcast"}
# Shardcast: a shard not yet on a middle node is retried after 1 s (its default 2 s, an int knob)
PEER_ENV = {"SHARDCAST_FAST_RETRY_INTERVAL": "1", "SHARDCAST_LOG_LEVEL": "WARNING"}


def _cpu_seconds(pid: int) -> float:
    """utime+stime of a process and its waited-for children, running or not yet reaped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class Trial:
    """One system at one setting in a fresh lab: the origin and N receivers, their processes'
    events in one queue, churn, and the row."""

    def __init__(self, Lab: type, args: argparse.Namespace, system: str, setting: str, work: Path) -> None:
        self.args, self.system, self.setting = args, system, setting
        self.work = work / f"{system}-{setting}".replace("/", "_")
        self.work.mkdir(parents=True)
        self.lab = Lab(uplink_mbps=args.uplink_mbps)
        self.origin = self.lab.add_peer("origin")
        self.receivers = [self.lab.add_peer(f"r{i}") for i in range(args.nodes)]
        self.events: queue.Queue = queue.Queue()
        self.procs: dict[str, subprocess.Popen] = {}
        self.done: dict[str, dict] = {}
        self.t0 = 0.0
        self.tx0 = 0
        self.cpu0 = 0.0
        self.victims_killed: set[str] = set()
        self.exited: set[str] = set()

    # --- processes -----------------------------------------------------------------------------
    def spawn(self, name: str, peer: object, argv: list[str]) -> subprocess.Popen:
        log = (self.work / f"{name}.log").open("w")
        p = subprocess.Popen(
            peer.cmd(*argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,  # type: ignore[attr-defined]
            text=True,
            env={**ENV, **PEER_ENV},
            start_new_session=True,
        )
        peer.procs.append(p)  # type: ignore[attr-defined]
        self.procs[name] = p
        threading.Thread(target=self._read, args=(name, p), daemon=True).start()
        return p

    def _read(self, name: str, p: subprocess.Popen) -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                self.events.put((name, obj))
        self.events.put((name, {"event": "exit"}))

    def send(self, name: str, line: str) -> None:
        try:
            self.procs[name].stdin.write(line + "\n")  # type: ignore[union-attr]
            self.procs[name].stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError):
            pass

    def expect(self, names: set[str], event: str, timeout: float) -> dict[str, dict]:
        """Wait for ``event`` from each of ``names``; the others' events are handled on the way."""
        got: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        while names - set(got):
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.system}: no {event!r} from {sorted(names - set(got))} (logs in {self.work})")
            try:
                name, obj = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            self.handle(name, obj)
            if obj.get("event") == event and name in names:
                got[name] = obj
            elif obj.get("event") == "exit" and name in names and name not in self.victims_killed:
                raise RuntimeError(f"{self.system}: {name} exited before {event!r} (logs in {self.work})")
        return got

    def handle(self, name: str, obj: dict) -> None:
        event = obj.get("event")
        if event == "version" and obj.get("version") == 2:  # an echorl relay: the timed version
            event = "done"
        if event == "exit":
            self.exited.add(name)
        if event == "done" and name not in self.done:
            self.done[name] = obj
        elif event in ("start", "publishing"):  # an origin, or echorl's broadcaster, begins
            self.start(obj["t0"])

    def mark(self) -> None:
        """Origin tx bytes and everyone's CPU time now: the run's costs are counted from here."""
        self.tx0 = self.tx_bytes()
        self.cpu0 = self.cpu_seconds()

    def cpu_seconds(self) -> float:
        return sum(_cpu_seconds(p.pid) for p in self.procs.values())

    def start(self, t0: float) -> None:
        if not self.t0:
            self.t0 = t0
            if not self.tx0:  # echorl: its broadcaster starts the timed version on its own
                self.mark()
            if self.args.churn > 0:
                threading.Thread(target=self._churn, daemon=True).start()

    def tx_bytes(self) -> int:
        out = self.lab.run(self.origin, ["cat", "/sys/class/net/eth0/statistics/tx_bytes"], timeout=30)
        return int(out.stdout.strip() or 0)

    # --- churn ----------------------------------------------------------------------------------
    def victims(self) -> list[str]:
        k = math.ceil(self.args.churn * self.args.nodes) if self.args.churn > 0 else 0
        names = [f"r{i}" for i in range(self.args.nodes)]
        return (names[1::4] + [n for n in names if n not in names[1::4]])[:k]

    def _churn(self) -> None:
        time.sleep(max(0.0, self.t0 + self.bound / 2 - time.time()))
        self.victims_killed = set(self.victims())
        for name in self.victims_killed:
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)

    # --- the run --------------------------------------------------------------------------------
    @property
    def bound(self) -> float:
        return self.args.bytes / (self.args.uplink_mbps * 1e6 / 8)

    def collect(self, receivers: list[str]) -> dict:
        """Wait until every receiver still alive holds a copy (or the deadline); then the row."""
        deadline = time.monotonic() + self.args.timeout
        while time.monotonic() < deadline:
            alive = [n for n in receivers if n not in self.victims_killed and n not in self.exited]
            if all(n in self.done for n in alive) and (self.args.churn == 0 or self.victims_killed):
                break
            try:
                self.handle(*self.events.get(timeout=1.0))
            except queue.Empty:
                pass
        tx = self.tx_bytes() - self.tx0
        cpu = self.cpu_seconds() - self.cpu0
        ok = {n: d for n, d in self.done.items() if n in receivers and d.get("digest") == self.args.digest}
        times = sorted(d["t"] - self.t0 for d in ok.values())
        survivors = [n for n in receivers if n not in self.victims_killed]
        finished = all(n in ok for n in survivors)
        return {
            "system": self.system,
            "setting": self.setting,
            "nodes": self.args.nodes,
            "size_mb": self.args.size_mb,
            "uplink_mbps": self.args.uplink_mbps,
            "churn": self.args.churn,
            "seconds": round(times[-1], 3) if times and finished else None,
            "p50_seconds": round(statistics.median(times), 3) if times else None,
            "origin_upload_bytes": tx,
            "origin_upload_copies": round(tx / self.args.bytes, 3),
            "cpu_seconds": round(cpu, 2),
            "lower_bound_seconds": round(self.bound, 3),
            "receivers_verified": len(ok),
            "receivers_killed": len(self.victims_killed),
            "survivors_verified": sum(n in ok for n in survivors),
            "survivors": len(survivors),
            "bad_digests": sum(1 for n, d in self.done.items() if d.get("digest") != self.args.digest),
        }

    def close(self, keep_logs: bool) -> None:
        """Tear the lab down; a failed or incomplete trial's logs are kept (path on stderr)."""
        self.lab.close()
        if keep_logs:
            kept = Path(tempfile.mkdtemp(prefix=f"versus-{self.system}-", dir="/var/tmp"))
            for log in self.work.glob("*.log"):
                shutil.copy(log, kept / log.name)
            print(f"bench/versus.py: {self.system} {self.setting}: logs in {kept}", file=sys.stderr)
        shutil.rmtree(self.work, ignore_errors=True)


# --- the systems ----------------------------------------------------------------------------------
def run_echorl(t: Trial, direct: bool, pace_mbps: float) -> dict:
    a = argparse.Namespace(
        size_mb=t.args.size_mb,
        fanout=t.args.fanout,
        chunk_kb=t.args.chunk_kb,
        timeout=t.args.timeout,
        no_direct=not direct,
        pace_mbps=pace_mbps,
    )
    t.spawn("origin", t.origin, broadcaster_argv(a))
    addr = t.expect({"origin"}, "ready", 120)["origin"]["addr"]
    names = [r.name for r in t.receivers]
    for r in t.receivers:
        t.spawn(r.name, r, relay_argv(addr, not direct, pace_mbps))
    ready = t.expect(set(names), "ready", 120)
    t.send(
        "origin",
        json.dumps([{"peer_id": ready[n]["peer_id"], "addrs": ready[n]["addrs"], "reachable": True} for n in names]),
    )
    t.expect({"origin"}, "publishing", t.args.timeout)
    row = t.collect(names)
    try:  # the broadcaster's own count of its interface's bytes during the timed version
        sent = t.expect({"origin"}, "result", 30 if row["seconds"] else 1)["origin"]["learner_tx_bytes"]
        row["origin_upload_bytes"], row["origin_upload_copies"] = sent, round(sent / t.args.bytes, 3)
    except RuntimeError:
        pass
    return row


def run_one_to_many(t: Trial) -> dict:
    t.spawn("origin", t.origin, [*PEERS, "o2m-origin", "--file", str(t.args.payload), "--port", str(PORT)])
    names = [r.name for r in t.receivers]
    for r in t.receivers:
        t.spawn(r.name, r, [*PEERS, "o2m-recv", "--origin", t.origin.ip, "--port", str(PORT)])
    t.expect({"origin", *names}, "ready", 120)
    t.mark()
    for n in names:
        t.send(n, "go")
    t.send("origin", "go")
    return t.collect(names)


def run_shardcast(t: Trial, middles: int, shard_bytes: int) -> dict:
    t.spawn(
        "origin",
        t.origin,
        [*PEERS, "sc-origin", "--file", str(t.args.payload), "--port", str(PORT), "--dir", str(t.work / "origin")],
    )
    t.expect({"origin"}, "ready", 120)
    mids, clients = t.receivers[:middles], t.receivers[middles:]
    for r in mids:
        t.spawn(
            r.name,
            r,
            [*PEERS, "sc-middle", "--origin", t.origin.ip, "--port", str(PORT), "--dir", str(t.work / r.name)],
        )
    t.expect({r.name for r in mids}, "ready", 120)
    for r in clients:
        t.spawn(
            r.name,
            r,
            [
                *PEERS,
                "sc-client",
                "--middles",
                ",".join(m.ip for m in mids),
                "--port",
                str(PORT),
                "--dir",
                str(t.work / r.name),
            ],
        )
    t.expect({r.name for r in clients}, "ready", 120)
    t.mark()
    t.send("origin", "go")
    return t.collect([r.name for r in t.receivers])


def run_lattica(t: Trial, block_bytes: int, concurrency: int) -> dict:
    t.spawn(
        "origin",
        t.origin,
        [
            *PEERS,
            "lat-origin",
            "--file",
            str(t.args.payload),
            "--port",
            str(PORT),
            "--ip",
            t.origin.ip,
            "--dir",
            str(t.work / "origin"),
            "--block-bytes",
            str(block_bytes),
        ],
    )
    addr = t.expect({"origin"}, "ready", 120)["origin"]["addr"]
    names, addrs = [r.name for r in t.receivers], [addr]
    for i, r in enumerate(t.receivers):  # one at a time: each bootstraps with every peer before it
        t.spawn(
            r.name,
            r,
            [
                *PEERS,
                "lat-recv",
                "--bootstrap",
                ",".join(addrs),
                "--dir",
                str(t.work / r.name),
                "--ip",
                r.ip,
                "--port",
                str(PORT),
                "--concurrency",
                str(concurrency),
                "--seed",
                str(i),
            ],
        )
        addrs.append(t.expect({r.name}, "ready", 120)[r.name]["addr"])
    time.sleep(2.0)  # Kademlia bootstrap: the receivers find each other through the origin
    t.mark()
    t.send("origin", "go")
    cids = t.expect({"origin"}, "blocks", t.args.timeout)["origin"]["cids"]
    for n in names:
        t.send(n, json.dumps(cids))
    return t.collect(names)


def trials(args: argparse.Namespace) -> list[tuple[str, str, object]]:
    """(system, setting, run function) for every system and setting asked for."""
    out: list[tuple[str, str, object]] = []
    for system in args.systems:
        if system.startswith("echorl-"):
            chunk = f"chunk{args.chunk_kb:g}k" if args.chunk_kb else "chunkauto"
            for fraction in args.pace:
                mbps = round(fraction * args.uplink_mbps, 3)
                out.append(
                    (
                        system,
                        f"fanout{args.fanout}-{chunk}-" + (f"pace{mbps:g}" if mbps else "unpaced"),
                        lambda t, d=system == "echorl-direct", m=mbps: run_echorl(t, d, m),
                    )
                )
        elif system == "one-to-many":
            out.append((system, "tcp", run_one_to_many))
        elif system == "shardcast":
            for s in args.shardcast:
                m, mb = s.split(":")
                mids = max(1, round(math.sqrt(args.nodes))) if m == "sqrt" else int(m)
                out.append(
                    (
                        system,
                        f"middles{mids}-shard{mb}MB",
                        lambda t, mids=mids, b=int(float(mb) * 1e6): run_shardcast(t, mids, b),
                    )
                )
        elif system == "lattica":
            for s in args.lattica:
                kb, c = s.split(":")
                out.append((system, f"block{kb}k-conc{c}", lambda t, b=int(kb) * 1024, c=int(c): run_lattica(t, b, c)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=8, help="receivers (the origin is one more peer)")
    ap.add_argument("--size-mb", type=float, default=8.0)
    ap.add_argument("--uplink-mbps", type=float, default=20.0, help="tbf cap of every peer's uplink")
    ap.add_argument("--churn", type=float, default=0.0, help="fraction of receivers killed at t0 + W/B/2")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--fanout", type=int, default=4, help="echorl: plan fanout")
    ap.add_argument(
        "--chunk-kb", type=float, default=0.0, help="echorl: chunk size (0: the learner's default, auto_chunk_bytes)"
    )
    ap.add_argument(
        "--pace",
        default="0.95,0",
        help="echorl: every peer's --upload-mbps as fractions of --uplink-mbps, comma-separated, "
        "each one trial (0: unpaced; docs/network-notes.md tells volunteers 0.95)",
    )
    ap.add_argument(
        "--lattica", default="256:2,64:2", help="settings BLOCK_KB:CONCURRENCY, comma-separated (each is one trial)"
    )
    ap.add_argument(
        "--shardcast",
        default="sqrt:1,2:50",
        help="settings MIDDLES:SHARD_MB (MIDDLES a number or sqrt), comma-separated",
    )
    ap.add_argument("--timeout", type=float, default=0.0, help="per trial (default 2·N·W/B + 60 s)")
    ap.add_argument("--keep-logs", default="", help="copy every trial's peer logs here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.systems = [s for s in args.systems.split(",") if s]
    args.lattica = [s for s in args.lattica.split(",") if s]
    args.shardcast = [s for s in args.shardcast.split(",") if s]
    args.pace = [float(s) for s in args.pace.split(",") if s]
    Lab, unavailable = _lab_module()
    why = unavailable()
    if why:
        sys.exit(f"bench/versus.py: network lab unavailable: {why}")
    from broadcast import fake_safetensors  # bench/broadcast.py

    with tempfile.TemporaryDirectory(prefix="versus-", dir="/var/tmp") as tmp:
        work = Path(args.keep_logs) if args.keep_logs else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        data = fake_safetensors(int(args.size_mb * 1024 * 1024), 2)  # what bench/netlab.py times (version 2)
        args.payload, args.bytes, args.digest = work / "payload.bin", len(data), hashlib.sha256(data).hexdigest()
        args.payload.write_bytes(data)
        del data
        bound = args.bytes / (args.uplink_mbps * 1e6 / 8)
        args.timeout = args.timeout or 2 * args.nodes * bound + 60
        for system, setting, run in trials(args):
            need = NEEDS.get(system)
            if need and importlib.util.find_spec(need) is None:
                emit({"system": system, "skipped": f"`{need}` is not installed (pip install -e '.[bench]')"}, args.json)
                continue
            t = Trial(Lab, args, system, setting, work)
            row: dict = {"system": system, "setting": setting, "error": "interrupted"}
            try:
                row = run(t)  # type: ignore[operator]
            except RuntimeError as exc:
                row = {"system": system, "setting": setting, "error": str(exc)[:500]}
            finally:
                t.close(keep_logs=bool(args.keep_logs) or "error" in row or row.get("seconds") is None)
            emit(row, args.json)


if __name__ == "__main__":
    main()
