"""A network lab on one Linux machine: every peer in its own network namespace.

Topology (all inside namespaces this lab creates; nothing is added to the root namespace)::

    hub ns: bridge br0 (no address) ── veth ── peer ns "learner"  198.18.0.1/24   (tbf uplink)
                                    ├─ veth ── peer ns "pub-N"    198.18.0.x/24   (tbf uplink)
                                    ├─ veth ── peer ns "status"   198.18.0.x/24
                                    └─ veth ── nat ns eth0        198.18.0.254/24
    nat ns: nftables masquerade out of eth0, drops new inbound; bridge lan0 198.18.1.1/24
                                    └─ veth ── peer ns "nat-N"    198.18.1.x/24, default via .1
    nat1 ns (only when a peer asks for ``nat_index=1``): the same, public side 198.18.0.253,
    LAN 198.18.2.0/24 (two NATs: NAT-to-NAT experiments such as hole punching)

A NAT'd node reaches every public peer (its connections leave masqueraded as 198.18.0.254); no
public peer can dial it (no route to 198.18.1.0/24, and the NAT drops unsolicited inbound).
Each peer's uplink is capped with ``tc tbf`` on its own side of its veth.

Only 198.18.0.0/15 (RFC 2544 benchmarking space) is used, only between these namespaces.
Teardown (``close``) kills every process in the lab's namespaces and deletes them, which removes
the veths, bridges and nft tables with them; it runs on ``close``, at exit (atexit) and, for labs
whose creating process died, at the start of the next lab (by the ``echorl-lab-<pid>-`` prefix).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "echorl-lab-"
PUBLIC_NET = "198.18.0"
NAT_NET = "198.18.1"
# per NAT index: (namespace role, public address on the hub, LAN prefix)
NATS = (("nat", f"{PUBLIC_NET}.254", NAT_NET), ("nat1", f"{PUBLIC_NET}.253", "198.18.2"))


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why a lab cannot be built here (None: it can): root, ``ip``, ``tc``, ``nft``, netns."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (scripts/ensure-build-deps.sh installs iproute2 and nftables)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def lab_namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _ip("netns", "del", ns, check=False)


def clean_leftovers() -> list[str]:
    """Delete namespaces of labs whose creating process is gone; returns their names."""
    gone = []
    for ns in lab_namespaces():
        owner = ns[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _pid_alive(int(owner)):
            _delete_namespace(ns)
            gone.append(ns)
    return gone


@dataclass
class Peer:
    name: str
    ns: str
    ip: str
    nat: bool
    procs: list[subprocess.Popen] = field(default_factory=list)

    def cmd(self, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]


class Lab:
    """Build with ``Lab()``; add peers; ``close()`` (or the context manager) tears it down."""

    def __init__(self, uplink_mbps: float = 0.0, nat_silent: bool = False) -> None:
        """``nat_silent``: the NATs also drop unsolicited packets addressed to their own public
        side, as most home routers do; without it (the default) the NAT's kernel answers an
        unsolicited SYN with a RST ("connection refused"), which defeats TCP hole punching."""
        clean_leftovers()
        self.nat_silent = nat_silent
        self.tag = f"{PREFIX}{os.getpid()}-{os.urandom(2).hex()}"
        self.uplink_mbps = uplink_mbps
        self.peers: dict[str, Peer] = {}
        self._namespaces: list[str] = []
        self._next = {"pub": 2, "nat": 2, "nat1": 2}
        self._nat_ns: dict[int, str] = {}
        atexit.register(self.close)
        try:
            self.hub = self._namespace("hub")
            self._run(self.hub, "ip", "link", "add", "br0", "type", "bridge")
            self._run(self.hub, "ip", "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- building -------------------------------------------------------------------------------
    def _namespace(self, role: str) -> str:
        ns = f"{self.tag}-{role}"
        _ip("netns", "add", ns)
        self._namespaces.append(ns)
        self._run(ns, "ip", "link", "set", "lo", "up")
        return ns

    @staticmethod
    def _run(ns: str, *argv: str) -> str:
        out = subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=30)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} in {ns}: {out.stderr.strip()}")
        return out.stdout

    def _wire(self, ns: str, bridge_ns: str, bridge: str, port: str, ip: str, mbps: float) -> None:
        """A veth from ``ns`` (eth0, ``ip``/24) to ``bridge`` in ``bridge_ns``; tbf on eth0."""
        _ip("-n", bridge_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self._run(bridge_ns, "ip", "link", "set", port, "master", bridge, "up")
        self._run(ns, "ip", "addr", "add", f"{ip}/24", "dev", "eth0")
        self._run(ns, "ip", "link", "set", "eth0", "up")
        if mbps > 0:  # the peer's uplink: what it sends out of eth0
            burst = max(16 * 1024, int(mbps * 1e6 / 8 / 100))  # ~10 ms at line rate
            self._run(
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                f"{mbps}mbit",
                "burst",
                str(burst),
                "latency",
                "200ms",
            )

    def _build_nat(self, index: int) -> str:
        role, public_ip, lan = NATS[index]
        nat = self._namespace(role)
        self._wire(nat, self.hub, "br0", f"v{role}", public_ip, 0.0)
        self._run(nat, "ip", "link", "add", "lan0", "type", "bridge")
        self._run(nat, "ip", "addr", "add", f"{lan}.1/24", "dev", "lan0")
        self._run(nat, "ip", "link", "set", "lan0", "up")
        self._run(nat, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = (
            "table ip echorl_lab_nat {\n"
            ' chain masq { type nat hook postrouting priority 100; oifname "eth0" masquerade; }\n'
            " chain gate { type filter hook forward priority 0; policy drop;\n"
            '  ct state established,related accept; iifname "lan0" oifname "eth0" accept; }\n'
            + (
                " chain mute { type filter hook input priority 0;\n"
                '  iifname "eth0" ct state established,related accept; iifname "eth0" drop; }\n'
                if self.nat_silent
                else ""
            )
            + "}\n"
        )
        out = subprocess.run(
            ["ip", "netns", "exec", nat, "nft", "-f", "-"], input=rules, capture_output=True, text=True, timeout=30
        )
        if out.returncode != 0:
            raise RuntimeError(f"nft in {nat}: {out.stderr.strip()}")
        if index == 0:
            self.nat_ns = nat
        self._nat_ns[index] = nat
        return nat

    def add_peer(self, name: str, nat: bool = False, uplink_mbps: float | None = None, nat_index: int = 0) -> Peer:
        """A namespace with one address: public (198.18.0.x on the hub bridge) or behind a NAT
        (``nat_index`` 0: 198.18.1.x behind 198.18.0.254; 1: 198.18.2.x behind 198.18.0.253;
        on that NAT's LAN bridge, default route through it)."""
        if nat and nat_index not in range(len(NATS)):
            raise ValueError(f"nat_index must be 0..{len(NATS) - 1}, got {nat_index}")
        mbps = self.uplink_mbps if uplink_mbps is None else uplink_mbps
        kind = NATS[nat_index][0] if nat else "pub"
        if name == "learner" and not nat:
            host = 1
        else:
            host = self._next[kind]
            self._next[kind] += 1
        if nat and nat_index not in self._nat_ns:
            self._build_nat(nat_index)
        ns = self._namespace(name)
        lan = NATS[nat_index][2]
        ip = f"{lan if nat else PUBLIC_NET}.{host}"
        port = f"v{kind}{host}"
        if nat:
            self._wire(ns, self._nat_ns[nat_index], "lan0", port, ip, mbps)
            self._run(ns, "ip", "route", "add", "default", "via", f"{lan}.1")
        else:
            self._wire(ns, self.hub, "br0", port, ip, mbps)
        peer = Peer(name, ns, ip, nat)
        self.peers[name] = peer
        return peer

    # --- running --------------------------------------------------------------------------------
    def spawn(self, peer: Peer, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        p = subprocess.Popen(
            peer.cmd(*argv), stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        peer.procs.append(p)
        return p

    def run(
        self, peer: Peer, argv: list[str], timeout: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        return subprocess.run(peer.cmd(*argv), capture_output=True, text=True, timeout=timeout, env=env)

    def stop_processes(self, grace_s: float = 20.0) -> None:
        procs = [p for peer in self.peers.values() for p in peer.procs if p.poll() is None]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def close(self) -> None:
        """Stop every process, delete every namespace of this lab (idempotent)."""
        try:
            self.stop_processes(grace_s=10.0)
        finally:
            for ns in reversed(self._namespaces):
                _delete_namespace(ns)
            self._namespaces.clear()
            atexit.unregister(self.close)
