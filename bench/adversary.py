"""Honest goodput under attack: each attack class running vs none, against one real learner.

    python bench/adversary.py --json                       # every class, 30 s windows
    python bench/adversary.py --json --window 20 --only lease_hoarder,half_open_tcp
    python bench/adversary.py --json --window 30 --only slow_walker_3 --spot-check-fraction 0

One learner process and ``--nodes`` honest node processes (``tests/swarm.py``) on loopback, the
tiny default model. For each attack class in turn: a clean window (no attack) of ``--window``
seconds, then an attack window of the same length in which one hostile peer (or a crowd, for
the Sybil flood and half-open connections) runs that class's attack in this process
(``tests/hostile.py`` has the doubles), then the next clean window. Measured per window from the
learner's metrics rows: honest goodput (rollout groups of the honest nodes' accepted submissions,
per second: ``per_node_groups_generated``) and optimizer steps per second. Not the groups *paid*
(``per_node_groups``): a group whose samples all agree carries no signal and is not paid, and as
the policy converges on addition that share grows (``zero_var_group_frac`` 0 → 0.56 in ten
minutes), so paid groups per second fell ~3 × over a long run with no attack at all. The
baseline of an attack window is the mean of the clean windows just before and just after it,
in the same learner run, so a drift of the machine's load or of the run itself is shared by both.

One JSON line per class (``--json``): ``attack``, ``goodput_ratio`` and ``steps_ratio``
(attack / clean), ``clean_goodput``, ``attack_goodput``, ``clean_steps_per_s``,
``attack_steps_per_s``, ``window_s``, ``learner_alive``, ``attacker_saw`` (what the learner
answered the attacker, by code), ``learner_in_window`` (the learner's lease and submission
counters that changed in the attack window, its CPU in cores, its mean broadcast seconds) and
``loadavg``; ``ssrf_ticket`` also ``bytes_to_other_addresses``
(bytes that reached an address other than the authenticated peer's). The target is ≥ 0.8 for
every class, and 0 bytes to other addresses.

Each class is one small function below (``ATTACKS``); add one there to measure a new attack.
Identities of the many-address classes listen on and dial from loopback addresses of their own
(``bench/_loopback.py``), so the learner's per-address rules see them as separate hosts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import trio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the shared hostile doubles and the process swarm

from _loopback import bind_dials, listen_on, loopback  # noqa: E402 - bench/ is on sys.path when run as a script
from _report import emit  # noqa: E402
from hostile import (  # noqa: E402
    RUN,
    SilentRelay,
    ThirdParty,
    aimed_addrs,
    empty_completion_body,
    fake_done,
    framed,
    join,
    newest_lease,
    nonfinite_logprob_body,
    oversized_header,
    plan_member,
    raw_request,
    ticket_to,
)
from swarm import Swarm, signed_submit  # noqa: E402

from echorl.broadcast.store import plan_for  # noqa: E402
from echorl.learner.pace import PROVEN_LEASES  # noqa: E402
from echorl.net.host import HostConfig, RemoteError, open_host  # noqa: E402
from echorl.protocol import routes, wire  # noqa: E402
from echorl.protocol.identity import Identity, load_identity, short_id  # noqa: E402
from echorl.protocol.messages import (  # noqa: E402
    BroadcastAck,
    Lease,
    LeaseDeferred,
    LeaseRequest,
    PlanAnnounce,
    PlanMember,
    Status,
    StatusRequest,
)
from echorl.protocol.routes import DONE  # noqa: E402

CONFIG = {"eval_every": 100000, "steps": 0, "checkpoint_dir": "none"}  # the learner's defaults otherwise
# the adversary tests' small run: its in-flight cap is B·(S − 1) = 4 prompts, so one lease of 2
# held by an attacker is half the budget (see the report's note on --small)
SMALL = {"prompts_per_step": 4, "prompts_per_lease": 2, "group_size": 2, "staleness": 2}


@dataclass
class Target:
    addr: str  # the learner's multiaddr
    learner: str  # its peer id
    honest: list[str]  # the honest nodes' peer ids


Attack = Callable[[Target, Counter], Awaitable[None]]
#: counts an attack keeps in its ``seen`` that are figures of their own (not what it was answered)
REPORTED = ("bytes_to_other_addresses",)
ATTACKS: dict[str, Attack] = {}


def attack(name: str) -> Callable[[Attack], Attack]:
    def register(fn: Attack) -> Attack:
        ATTACKS[name] = fn
        return fn

    return register


async def forever(step: Callable[[], Awaitable[str]], seen: Counter, pause: float = 0.0) -> None:
    """Repeat one hostile request, counting what the learner answered (an attacker never stops
    on a refusal)."""
    while True:
        try:
            seen[await step()] += 1
        except RemoteError as exc:
            seen[exc.code.value] += 1
        except Exception as exc:
            seen[type(exc).__name__] += 1
            await trio.sleep(0.2)
        await trio.sleep(pause)


@asynccontextmanager
async def joined(t: Target, tokens_per_s: float = 1.0, ip: str | None = None) -> AsyncIterator[tuple[Any, Identity]]:
    """A fresh identity, connected and joined; from ``ip`` (a loopback address of
    ``bench/_loopback.py``: listening and dialling from it) when given, else from the bench's own
    address (127.0.0.1, the honest nodes' too)."""
    me = Identity.generate()
    async with open_host(me, HostConfig(listen=listen_on(ip)) if ip else None) as host:
        if ip:
            bind_dials(host, ip)
        await host.connect(t.addr)
        await join(host, t.learner, me, tokens_per_s)
        yield host, me


async def published(host: Any, t: Target) -> int:
    st = await host.request(t.learner, routes.STATUS, StatusRequest(), expect=Status)
    return int(st.learner.get("published_version", st.learner.get("version", 0)) or 0)


def lease_then(host: Any, me: Identity, t: Target, submit: Callable[[Lease, int], Awaitable[str]]):
    async def step() -> str:
        lease, v = await newest_lease(host, t.learner, tries=100)
        return await submit(lease, v)

    return step


@attack("nonfinite_logprobs")
async def nonfinite_logprobs(t: Target, seen: Counter) -> None:
    """Alternately a −1e300 behaviour log-prob (−inf as float32) and a finite −80 one."""
    async with joined(t) as (host, me):
        flip = [False]

        async def submit(lease: Lease, v: int) -> str:
            flip[0] = not flip[0]
            if flip[0]:
                body = nonfinite_logprob_body(signed_submit(me, lease, v, token_ids=(4,), logprobs=(-1.0,)))
                return await raw_request(host, t.learner, routes.SUBMIT, framed(body))
            await host.request(t.learner, routes.SUBMIT, signed_submit(me, lease, v, token_ids=(4,), logprobs=(-80.0,)))
            return "accepted_-80"

        await forever(lease_then(host, me, t, submit), seen)


@attack("empty_completions")
async def empty_completions(t: Target, seen: Counter) -> None:
    async with joined(t) as (host, me):

        async def submit(lease: Lease, v: int) -> str:
            return await raw_request(host, t.learner, routes.SUBMIT, framed(empty_completion_body(lease, v, me)))

        await forever(lease_then(host, me, t, submit), seen)


async def fabricated(t: Target, seen: Counter, token_ids: tuple[int, ...], version_ahead: int = 0) -> None:
    """Lease, then submit a fabricated sample (``token_ids``) claiming the leased version plus
    ``version_ahead``, forever."""
    async with joined(t) as (host, me):

        async def submit(lease: Lease, v: int) -> str:
            msg = signed_submit(me, lease, v + version_ahead, token_ids=token_ids, logprobs=(-1.0,) * len(token_ids))
            await host.request(t.learner, routes.SUBMIT, msg)
            return "accepted"

        await forever(lease_then(host, me, t, submit), seen)


@attack("tokens_after_eos")
async def tokens_after_eos(t: Target, seen: Counter) -> None:
    await fabricated(t, seen, (4, 1, 5))  # 1: the tiny model's EOS


@attack("unpublished_versions")
async def unpublished_versions(t: Target, seen: Counter) -> None:
    await fabricated(t, seen, (4,), version_ahead=1)


async def ask_lease(host: Any, t: Target, version: list[int], max_prompts: int, obey: bool = False) -> Any:
    """One LEASE request at ``version[0]`` (the version the learner last asked for: a deferral
    updates it): the deferral's reason, or the reply itself. ``obey``: after a deferral, sleep
    its ``retry_after_s`` (asking earlier is refused, and repeated, struck off)."""
    reply = await host.request(
        t.learner, routes.LEASE, LeaseRequest(run_id=RUN, version=version[0], max_prompts=max_prompts)
    )
    if isinstance(reply, LeaseDeferred):
        version[0] = reply.want_version if reply.want_version >= 0 else version[0]
        if obey:
            await trio.sleep(reply.retry_after_s)
        return reply.reason
    return reply


@attack("lease_hoarder")
async def lease_hoarder(t: Target, seen: Counter) -> None:
    """~25 lease requests a second, a declared 0 tok/s, never a submission."""
    async with joined(t, tokens_per_s=0.0) as (host, _):
        version = [2**40]

        async def ask() -> str:
            reply = await ask_lease(host, t, version, max_prompts=2)
            if isinstance(reply, str):
                return reply
            return "lease" if isinstance(reply, Lease) else type(reply).__name__

        await forever(ask, seen, pause=0.04)


@attack("silent_plan_member")
async def silent_plan_member(t: Target, seen: Counter) -> None:
    """Joins as a reachable node, acknowledges every plan announce, never reports done."""
    async with joined(t) as (host, _), trio.open_nursery() as nursery:
        plan_member(host, nursery, t.learner, report=False)
        seen["joined"] += 1
        await trio.sleep_forever()


@attack("fake_broadcast_done")
async def fake_broadcast_done(t: Target, seen: Counter) -> None:
    """Ten times a second: 'the honest nodes sent me bad chunks' for the newest version."""
    async with joined(t) as (host, _):

        async def accuse() -> str:
            await host.request(t.learner, DONE, fake_done(await published(host, t), t.honest))
            return "accepted"

        await forever(accuse, seen, pause=0.1)


@attack("oversized_unauthenticated_frames")
async def oversized_unauthenticated_frames(t: Target, seen: Counter) -> None:
    """A peer that never joined: four streams at a time announcing a 16 MiB SUBMIT body."""
    async with open_host(Identity.generate()) as stranger:
        await stranger.connect(t.addr)

        async def frame() -> str:
            return await raw_request(stranger, t.learner, routes.SUBMIT, oversized_header(16 << 20, 64 << 10))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(forever, frame, seen)


@attack("sybil_flood")
async def sybil_flood(t: Target, seen: Counter, identities: int = 48) -> None:
    """Many fresh identities (each its own host and connection) join with 0 tok/s and keep
    asking for leases they never answer."""

    async def one() -> None:
        try:
            async with joined(t, tokens_per_s=0.0) as (host, _):
                seen["joined"] += 1
                version = [2**40]

                async def ask() -> str:
                    reply = await host.request(
                        t.learner, routes.LEASE, LeaseRequest(run_id=RUN, version=version[0], max_prompts=2)
                    )
                    if isinstance(reply, LeaseDeferred):
                        version[0] = reply.want_version if reply.want_version >= 0 else version[0]
                        return reply.reason
                    return "lease"

                await forever(ask, seen, pause=1.0)
        except Exception as exc:
            seen[f"join_{getattr(getattr(exc, 'code', None), 'value', type(exc).__name__)}"] += 1

    async with trio.open_nursery() as nursery:
        for _ in range(identities):
            nursery.start_soon(one)
            await trio.sleep(0.05)


@attack("half_open_tcp")
async def half_open_tcp(t: Target, seen: Counter, connections: int = 300) -> None:
    """Raw TCP connections to the learner's port that never start a handshake, held open."""
    m = re.search(r"/ip4/([\d.]+)/tcp/(\d+)", t.addr)
    assert m, t.addr
    held = []
    try:
        for _ in range(connections):
            try:
                held.append(await trio.open_tcp_stream(m.group(1), int(m.group(2))))
                seen["held"] += 1
            except OSError as exc:
                seen[type(exc).__name__] += 1
        await trio.sleep_forever()
    finally:
        for s in held:
            s.socket.close()


async def work_once(host: Any, me: Identity, t: Target, seen: Counter) -> None:
    """One accepted submission: a worker, so plans make it a relay parent, not a leaf."""
    for _ in range(20):
        lease, v = await newest_lease(host, t.learner, tries=100)
        try:
            await host.request(t.learner, routes.SUBMIT, signed_submit(me, lease, v, token_ids=(4,), logprobs=(-80.0,)))
            seen["worked"] += 1
            return
        except RemoteError as exc:
            seen[exc.code.value] += 1


@attack("ssrf_ticket")
async def ssrf_ticket(t: Target, seen: Counter) -> None:
    """Joins with a third party's address (127.0.0.2) first in its own, works once (so plans
    make it a relay parent, not a leaf), reports every version done, and answers every ticket
    request (pulled or pushed) with the third party's port and ticket bytes of its choice.
    ``bytes_to_other_addresses``: what reached the third party (target: 0)."""
    target = ThirdParty()
    me = Identity.generate()
    async with open_host(me) as host, trio.open_nursery() as nursery:
        await nursery.start(target.run)
        await host.connect(t.addr)
        await join(host, t.learner, me, addrs=aimed_addrs(host, target))
        plan_member(host, nursery, t.learner, report=True)
        ticket_to(host, target)
        seen["bytes_to_other_addresses"] = 0
        await work_once(host, me, t, seen)
        while True:
            seen["bytes_to_other_addresses"] = target.bytes
            await trio.sleep(0.5)


@attack("silent_forwarder")
async def silent_forwarder(t: Target, seen: Counter, tries: int = 5000) -> None:
    """A worker that relays chunks and reports like an honest node but passes no announcement on
    to its stripe-0 children (issue 27). It grinds identities (they are free) against the plan an
    accomplice heard until one would be a stripe-0 parent of an honest node, joins with that one
    and answers ``PROVEN_LEASES`` leases (a proven worker relays; others are leaves). Its children
    then get the learner's copy at their deadline, and the learner stops relying on it (16
    publications, doubling at each offence)."""
    ann = await heard_plan(t, lambda a: any(m.peer_id in t.honest for m in a.members))
    # the accomplice leaves at once and is dropped from the plan once found gone: the honest remain
    others = [m.model_copy(update={"forward": None}) for m in ann.members if m.peer_id in t.honest]
    me = Identity.generate()
    for i in range(tries):
        me = Identity.generate()
        mine = PlanMember(peer_id=me.peer_id, reachable=True, addrs=[])
        plan = plan_for(ann.learner_peer_id, [*others, mine], ann.shape, ann.fanout, ann.seed)
        if any(c in t.honest for c in plan.children(me.peer_id, 0)):
            seen["identities_ground"] = i + 1
            break
    async with open_host(me) as host, trio.open_nursery() as nursery:
        relay = SilentRelay(host, t.learner, RUN)
        relay.install()
        nursery.start_soon(relay.run)
        await host.connect(t.addr)
        await join(host, t.learner, me)
        for _ in range(PROVEN_LEASES):  # proven (its last leases answered in time): a relay, not a leaf
            await work_once(host, me, t, seen)
        while True:
            seen["versions_taken"] = max(0, relay.version)
            held = list(relay.server.states.values())
            seen["stripe0_children_now"] = len(held[-1].plan.children(me.peer_id, 0)) if held else 0
            if held:
                mine_now = [m for m in held[-1].announce.members if m.peer_id == me.peer_id]
                seen["plan_members_now"] = len(held[-1].announce.members)
                seen["relay_in_plan_now"] = int(bool(mine_now and mine_now[0].reachable))
            await trio.sleep(0.5)


async def heard_plan(t: Target, until: Callable[[PlanAnnounce], bool]) -> PlanAnnounce:
    """The first plan announcement a joined accomplice hears for which ``until`` holds."""
    heard: list[PlanAnnounce] = []
    event = trio.Event()

    async def on_announce(msg: Any, ctx: Any) -> BroadcastAck:
        assert isinstance(msg, PlanAnnounce)
        if until(msg):
            heard.append(msg)
            event.set()
        return BroadcastAck(run_id=msg.run_id, version=msg.version, have_version=msg.version)

    async with joined(t) as (host, _):
        host.route(routes.ANNOUNCE, on_announce, request=PlanAnnounce)
        with trio.fail_after(120):
            await event.wait()
    return heard[0]


async def honest_addrs(t: Target) -> dict[str, list[str]]:
    """The honest nodes' addresses, as a joined accomplice hears them in the next plan."""
    ann = await heard_plan(t, lambda a: any(m.peer_id in t.honest and m.addrs for m in a.members))
    return {m.peer_id: list(m.addrs) for m in ann.members if m.peer_id in t.honest and m.addrs}


@attack("node_announce_flood")
async def node_announce_flood(t: Target, seen: Counter, streams: int = 4, identity_s: float = 10.0) -> None:
    """Strangers that never joined send whole 16 MiB ``ANNOUNCE`` frames to every honest node,
    four streams at a time per node; every ``identity_s`` a fresh identity takes over (one that
    was struck off gets nothing more)."""
    nodes = await honest_addrs(t)
    # a whole 16 MiB frame that decodes (a map with a 16 MiB byte string), so a node that reads
    # it first also pays the decode before the schema refuses it
    frame = framed(msgpack.packb({"type": "plan_announce", "pad": bytes((16 << 20) - 64)}))

    async def flood(stranger: Any, node: str) -> None:
        while True:
            try:
                seen[await raw_request(stranger, node, routes.ANNOUNCE, frame)] += 1
            except Exception as exc:
                seen[type(exc).__name__] += 1
                await trio.sleep(0.01)

    while True:
        seen["identities"] += 1
        try:
            async with open_host(Identity.generate()) as stranger:
                for addrs in nodes.values():
                    await stranger.connect(addrs[0])
                with trio.move_on_after(identity_s):
                    async with trio.open_nursery() as nursery:
                        for node in nodes:
                            for _ in range(streams):
                                nursery.start_soon(flood, stranger, node)
        except Exception as exc:
            seen[f"identity_{type(exc).__name__}"] += 1
            await trio.sleep(0.2)


async def slow_walker(t: Target, seen: Counter, identities: int, addresses: list[str | None]) -> None:
    """``identities`` joined identities on each of ``addresses`` (``None``: this process's own
    address, shared with the honest nodes); each answers its first lease at once (so the learner
    measures it fast), then holds every later one (two at a time) until just before its deadline
    and answers it; it polls for leases 25 times a second, or as often as a deferral's
    ``retry_after_s`` lets it (the fastest that is not refused and struck off)."""

    async def one(ip: str | None) -> None:
        async with joined(t, ip=ip) as (host, me), trio.open_nursery() as nursery:
            answered = [0]

            async def answer(lease: Lease, v: int) -> None:
                if answered[0] > 0:  # just before its deadline
                    await trio.sleep(max(0.0, lease.deadline_s - 0.3))
                answered[0] += 1
                try:
                    msg = signed_submit(me, lease, v, token_ids=(4,), logprobs=(-1.0,))
                    await host.request(t.learner, routes.SUBMIT, msg)
                    seen["accepted"] += 1
                except RemoteError as exc:
                    seen[exc.code.value] += 1

            version = [2**40]

            async def ask() -> str:
                reply = await ask_lease(host, t, version, max_prompts=8, obey=True)
                if isinstance(reply, str):
                    return reply
                assert isinstance(reply, Lease)
                nursery.start_soon(answer, reply, version[0])
                if answered[0] == 0:  # the first one is answered before it asks again
                    while answered[0] == 0:
                        await trio.sleep(0.01)
                return "lease"

            await forever(ask, seen, pause=0.04)

    async with trio.open_nursery() as nursery:
        for ip in addresses:
            for _ in range(identities):
                nursery.start_soon(attack_until_refused, lambda _t, _s, _ip=ip: one(_ip), t, seen)


@attack("slow_walker_3")
async def slow_walker_3(t: Target, seen: Counter) -> None:
    """3 identities from the bench's own address (the honest nodes' too: a shared NAT)."""
    await slow_walker(t, seen, 3, [None])


@attack("slow_walker_32")
async def slow_walker_32(t: Target, seen: Counter) -> None:
    """32 identities from one address of their own (127.0.0.2), not the honest nodes'."""
    await slow_walker(t, seen, 32, [loopback(0)])


@attack("slow_walker_8x4")
async def slow_walker_8x4(t: Target, seen: Counter) -> None:
    """4 identities from each of 8 loopback addresses of their own (127.0.0.3 … 127.0.0.10: not
    ``slow_walker_32``'s, whose members may still hold its address's join slots)."""
    await slow_walker(t, seen, 4, [loopback(1 + i) for i in range(8)])


@attack("activation_liar")
async def activation_liar(t: Target, seen: Counter, work_s: float = 2.0) -> None:
    """Asks nothing (price 0, like the honest nodes here) and says every lease took it 0 s, while
    it really answers each lease ``work_s`` after it got it. The learner runs with
    ``--activation cost`` when this class is measured (``main``): before, the claimed 0 s made it
    the only active node and parked every honest one."""
    async with joined(t) as (host, me):

        async def submit(lease: Lease, v: int) -> str:
            await trio.sleep(work_s)
            msg = signed_submit(me, lease, v, token_ids=(4,), logprobs=(-1.0,))
            msg = wire.sign(msg.model_copy(update={"generate_seconds": 0.0}), me)
            await host.request(t.learner, routes.SUBMIT, msg)
            return "accepted"

        await forever(lease_then(host, me, t, submit), seen)


@attack("bad_signature_flood")
async def bad_signature_flood(t: Target, seen: Counter, per_s: float = 50.0) -> None:
    """A joined identity takes a lease and sends the largest SUBMIT it allows (every sample
    ``max_new_tokens`` long) with a bad signature, ``per_s`` times a second; once struck off, a
    fresh identity joins and goes on."""
    while True:
        seen["identities"] += 1
        try:
            async with joined(t) as (host, me):
                lease, v = await newest_lease(host, t.learner, tries=100)
                m = lease.sampling.max_new_tokens
                msg = signed_submit(me, lease, v, token_ids=(4,) * m, logprobs=(-1.0,) * m)
                forged = msg.model_copy(update={"signature": bytes(64)})
                with trio.move_on_after(60):
                    while seen["cut_in_row"] < 3:
                        try:
                            await host.request(t.learner, routes.SUBMIT, forged, timeout=10.0)
                            seen["accepted"] += 1
                            seen["cut_in_row"] = 0
                        except RemoteError as exc:
                            seen[exc.code.value] += 1
                            seen["cut_in_row"] = 0
                        except Exception:
                            seen["cut"] += 1
                            seen["cut_in_row"] += 1
                        await trio.sleep(1.0 / per_s)
                seen["cut_in_row"] = 0
        except Exception as exc:
            seen[f"identity_{type(exc).__name__}"] += 1
            await trio.sleep(0.5)


# --- the harness ------------------------------------------------------------------------------
def honest_totals(swarm: Swarm, honest_short: set[str]) -> tuple[int, int]:
    """(steps, groups of the honest nodes' accepted submissions) of the learner's newest metrics row."""
    rows = [r for r in swarm.metrics() if r.get("step", 0) > 0]
    if not rows:
        return 0, 0
    last = rows[-1]
    accepted = last.get("per_node_groups_generated") or {}
    return int(last["step"]), sum(n for p, n in accepted.items() if p in honest_short)


#: the learner's counters reported per attack window (changed ones only): where its leases went
LEARNER_COUNTS = (
    "leases_issued",
    "leases_expired",
    "leases_late",
    "leases_refused",
    "leases_active",
    "rollouts_rejected_stale",
    "announce_sends",
    "announce_heard",
    "announce_late",
    "submissions_accepted",
    "joins_refused_ip_cap",
    "members_displaced",
)


def learner_counts(swarm: Swarm) -> dict[str, int]:
    """The newest metrics row's :data:`LEARNER_COUNTS` and the groups accepted from all members."""
    rows = swarm.metrics()
    last = rows[-1] if rows else {}
    out = {k: int(last[k]) for k in LEARNER_COUNTS if isinstance(last.get(k), (int, float))}
    out["groups_all_members"] = sum((last.get("per_node_groups") or {}).values())
    return out


def learner_cpu_s(swarm: Swarm) -> float:
    """The learner process's user + system CPU seconds so far (/proc; 0 once it is gone)."""
    try:
        fields = Path(f"/proc/{swarm.learner.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def attack_until_refused(fn: Attack, t: Target, seen: Counter) -> None:
    """Run one attack; the learner refusing it outright (e.g. ``peer_limit`` at its join) ends
    it and is counted, never the bench."""
    try:
        await fn(t, seen)
    except Exception as exc:
        leaf = exc
        while isinstance(leaf, BaseExceptionGroup) and leaf.exceptions:
            leaf = leaf.exceptions[0]
        code = getattr(leaf, "code", None)
        seen[f"stopped_{getattr(code, 'value', code) or type(leaf).__name__}"] += 1


async def window(
    swarm: Swarm, honest_short: set[str], seconds: float, target: Target, fn: Attack | None
) -> tuple[float, float, Counter]:
    """(honest groups/s, steps/s, the attacker's counts) over ``seconds`` with ``fn`` running.
    ``seen["cpu_ms"]``: CPU this process (the attacker, on the same cores) used in the window."""
    seen: Counter = Counter()
    async with trio.open_nursery() as nursery:
        s0, g0 = honest_totals(swarm, honest_short)
        rows0 = swarm.metrics()
        k0, cpu0 = learner_counts(swarm), learner_cpu_s(swarm)
        t0, c0 = time.monotonic(), time.process_time()
        if fn is not None:
            nursery.start_soon(attack_until_refused, fn, target, seen)
        await trio.sleep(seconds)
        s1, g1 = honest_totals(swarm, honest_short)
        dt = time.monotonic() - t0
        seen["cpu_ms"] = int(1000 * (time.process_time() - c0))
        k1, cpu1 = learner_counts(swarm), learner_cpu_s(swarm)
        rows = [r for r in swarm.metrics()[len(rows0) :] if r.get("broadcast_seconds") is not None]
        nursery.cancel_scope.cancel()
    # leases_active is a level, not a count: its value at the window's end
    changed: dict[str, float] = {k: v if k == "leases_active" else v - k0.get(k, 0) for k, v in k1.items()}
    changed["cpu_cores"] = round((cpu1 - cpu0) / dt, 3)
    if rows:  # the newest completed broadcast per metrics row: how long a version took to reach the nodes
        changed["broadcast_s_mean"] = round(sum(r["broadcast_seconds"] for r in rows) / len(rows), 3)
    seen.update({f"learner:{k}": v for k, v in changed.items() if v})
    return (g1 - g0) / dt, (s1 - s0) / dt, seen


async def run(args: argparse.Namespace, swarm: Swarm, tmp: Path) -> list[dict[str, Any]]:
    names = args.only.split(",") if args.only else list(ATTACKS)
    unknown = set(names) - set(ATTACKS)
    if unknown:
        raise SystemExit(f"unknown attack class: {', '.join(sorted(unknown))} (known: {', '.join(ATTACKS)})")
    addr = swarm.addr
    honest = [load_identity(tmp / f"honest{i}.key").peer_id for i in range(args.nodes)]
    target = Target(addr, addr.rsplit("/p2p/", 1)[1], honest)
    short = {short_id(p) for p in honest}
    changed = overrides(args)
    out = []
    before = await window(swarm, short, args.window, target, None)
    for name in names:
        att_g, att_s, seen = await window(swarm, short, args.window, target, ATTACKS[name])
        alive = swarm.learner.poll() is None
        after = await window(swarm, short, args.window, target, None)
        clean_g, clean_s = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
        out.append(
            {
                "attack": name,
                "goodput_ratio": round(att_g / clean_g, 3) if clean_g else None,
                "steps_ratio": round(att_s / clean_s, 3) if clean_s else None,
                "clean_goodput": round(clean_g, 3),
                "attack_goodput": round(att_g, 3),
                "clean_steps_per_s": round(clean_s, 3),
                "attack_steps_per_s": round(att_s, 3),
                "window_s": args.window,
                "learner_alive": alive,
                "attacker_cpu_cores": round(seen.pop("cpu_ms") / 1000 / args.window, 3),
                **{k: seen.pop(k) for k in REPORTED if k in seen},
                "learner_in_window": {k.split(":", 1)[1]: seen.pop(k) for k in list(seen) if k.startswith("learner:")},
                "attacker_saw": dict(seen.most_common(8)),
                "loadavg": [round(x, 2) for x in os.getloadavg()],
                "baseline": "mean of the clean windows just before and just after, same learner run",
                "nodes": args.nodes,
                "config": " ".join(["small" if args.small else "defaults", *(f"{k}={v}" for k, v in changed.items())]),
            }
        )
        before = after
        if args.json:
            print(json.dumps(out[-1]), flush=True)
        else:
            emit(out[-1], False)
    return out


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The learner settings the command line changes: the spot-check fraction if given, and
    ``--activation cost`` when ``activation_liar`` is measured (its attack is on that policy)."""
    out: dict[str, Any] = {}
    if args.spot_check_fraction is not None:
        out["spot_check_fraction"] = args.spot_check_fraction
    if "activation_liar" in (args.only.split(",") if args.only else ATTACKS):
        out["activation"] = "cost"
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--window", type=float, default=30.0, help="seconds per clean and per attack window")
    p.add_argument("--nodes", type=int, default=2, help="honest node processes")
    p.add_argument("--only", default="", help="comma-separated attack classes (default: all)")
    p.add_argument("--small", action="store_true", help="the adversary tests' small run (B=4, S=2, 2-prompt leases)")
    p.add_argument(
        "--spot-check-fraction",
        type=float,
        default=None,
        help="the learner's spot-check fraction (default: its own); 0 lets fabricated work in, as work an attacker "
        "really computed would be (the slow-walker classes measure the lease policy, not the spot checks)",
    )
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="echorl-adversary-") as d:
        tmp = Path(d)
        (tmp / "learner.json").write_text(json.dumps({**CONFIG, **(SMALL if args.small else {}), **overrides(args)}))
        swarm = Swarm(tmp)
        try:
            swarm.start_learner("--config", str(tmp / "learner.json"))
            for i in range(args.nodes):
                swarm.start_node(f"honest{i}")
            swarm.wait_for(lambda: honest_totals(swarm, set())[0] >= 3, timeout=300, what="3 clean steps")
            trio.run(run, args, swarm, tmp)
        finally:
            swarm.stop()


if __name__ == "__main__":
    main()
