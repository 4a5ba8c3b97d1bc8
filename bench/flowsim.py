"""Flow-level model of one broadcast version over the real plan (``protocol/plan.py``).

    python bench/flowsim.py --peers 10000 --nat 0.5 --size-mb 1024 --json
    python bench/flowsim.py --peers 10000 --nat 0.5 --size-mb 1024 --churn 0.4 --json
    python bench/flowsim.py --peers 16 --nat 0.5 --size-mb 8 --uplink-mbps 19 --down-ratio 0 --json

Pure Python, deterministic for a seed, no sockets. The peers' uplinks are drawn log-uniformly
between ``--uplink-mbps`` and ``--uplink-max-mbps`` (an assumption, see docs/broadcast-notes.md
"Flow-level simulator"), each downlink ``--down-ratio`` × its uplink (0: unlimited), a fraction
``--nat`` behind NAT (``PlanMember.pushes``, as the learner announces them). The real
``plan_broadcast`` builds the plan, each member weighted by its uplink (``PlanMember.weight``,
``uplinks.weight_of``: what the learner holds once every relay's children timed it, issue 27;
``--no-weights``: k child slots each, as before); then:

- **Rates** (fluid, constant per edge): a parent's uplink is shared max-min fairly across all
  its child streams in every stripe (the ``UploadLimiter`` is one FIFO bucket that every child
  stream pays into in ~5 ms slices); a stream cannot run faster than its parent receives that
  stripe, nor than the child's downlink share (downlink / incoming streams). Iterated to a
  fixed point.
- **Pipelining** by chunk (a relay forwards a chunk once it holds all of it): for child ``c`` of
  ``p`` at rate ``r``, with chunk ``c_b`` and stripe bytes ``S``: first chunk at
  ``f_c = f_p + c_b/r + hop``, stripe done at ``F_c = max(f_p + S/r, F_p + c_b/r) + hop``.
- **Churn**: a fraction ``--churn`` of the peers leave at uniform random times in
  [0, T₀] (T₀: the time without churn). A peer whose parent left before the stripe had passed
  it hears nothing for ``stall_s`` (relay default 10 s: the first-byte deadline), then is
  **adopted** by the first that the relay asks (``broadcast/adoption.py: adopters``, called
  here: ancestors, uncles, a stripe head's orphans their earlier siblings, the learner last)
  that stays, can be dialled (or is the learner) and has room (``VersionState.adopt``:
  ``fanout`` descendants and siblings a stripe, ``adoption_slots`` nephews): the rest of the
  stripe at a fair share of the adopter's uplink beside its streams to peers that stay, no
  faster than the adopter receives it; its own subtree follows it a chunk-time behind (a
  stalled parent that answers a ping is waited for once more, so they do not walk away). With
  no such ancestor (or ``adopt=False``, the relay before adoption, printed beside as
  ``no_adoption_*``) it pulls the rest of that stripe (``broadcast/recovery.py``): ``IN_FLIGHT``
  (4) chunk requests at a time, spread over its other parents (already connected) and those of
  ``PEERS_ASKED`` (8) random members that can be dialled (a NAT'd one fails and is skipped).
  A source serves a request at a fair share of its uplink beside its tree streams
  (``uplink / (streams + requests)``), a pull's requests counted at a source in proportion to
  the share of the version that pull lasts (leave times are spread over the version). Every
  descendant of a pulling peer pulls too (it forwards its first pulled chunk later than
  ``stall_s``), as the code does. A pull cannot end before the median member of that stripe
  holds it (sources only have what reached them).

Output, one JSON line: ``predicted_s``; ``lower_bound_s`` = max(W/B_learner, W/d_min,
N·W/(B_learner + Σ uᵢ)) (the minimum distribution time of any scheme in the uplink-sharing
model, Kumar & Ross, 1st IEEE HotWeb 2006, "Peer-assisted file distribution: the minimum
distribution time"; it ignores NAT, so it is also a bound with NAT); ``ratio``; ``plan_bound_s``
= max over uploaders of copiesᵢ·W/uᵢ (this plan's busiest uplink, the netlab's
``topology_bound_seconds`` for uneven uplinks); ``plan_build_s`` and ``announce_s`` (CPU
seconds: ``plan_broadcast``; building, signing and encoding the ``PlanAnnounce``);
``announce_bytes``; ``announce_receive_s`` (a node's CPU seconds to decode, verify and plan it);
``announce_sends`` and ``announce_upload_s`` (the copies the learner sends itself when the
announcement goes down the plan, ``broadcast/announcing.py``, once every member took the last one
under the same stripe-0 parent, and its uplink seconds for them), ``announce_upload_direct_s``
(the baseline: one copy per member from the learner) and ``announce_spread_s`` (until the deepest
member holds it: per hop a node's receive CPU and its flagged children's copies over its
uplink); the model leaves the announcement out of ``predicted_s``, where it would come first;
and ``baseline_ratio``, ``baseline_predicted_s``, ``baseline_depth``,
``baseline_plan_bound_s``: the same peers planned without weights (``--no-baseline`` skips them);
with ``--churn``, ``streams_adopted`` / ``streams_recovered`` and ``no_adoption_predicted_s``,
``no_adoption_ratio``: the same plan and departures with every cut stream pulling;
``adopt_floor`` and ``adopt_earlier``: the adoption rule the prediction used (``Adoption``: the
defaults are the relay's; ``--adopt-floor F`` and ``--adopt-earlier`` are what-ifs the relay does
not have: only adopters whose uplink share is F × the orphan's planned rate, and members earlier in
the stripe's breadth-first order after the ancestors).
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import emit

from echorl.broadcast.adoption import adopters, adoption_slots, is_nephew
from echorl.broadcast.recovery import IN_FLIGHT, PEERS_ASKED
from echorl.broadcast.uplinks import weight_of
from echorl.protocol.identity import peer_id_from_public_key
from echorl.protocol.plan import BroadcastPlan, PlanPeer, auto_chunk_bytes, plan_broadcast

MBIT = 1e6 / 8  # bytes/s per Mbit/s
LEARNER = "learner"
STALL_S = 10.0  # Relay(stall_s=...) default: silence on a chunk stream before it recovers
FIXED_POINT_ROUNDS = 60  # rate iterations; the plans here converge in < depth + 3
INF = float("inf")
LOAD_ROUNDS = 3  # pulls' load on their sources, re-weighted by how long each pull lasts


@dataclass(frozen=True)
class Peer:
    """One simulated member: uplink and downlink in bytes/s (downlink INF: unlimited)."""

    peer_id: str
    up: float
    down: float
    reachable: bool


def draw_peers(n: int, nat: float, up_min: float, up_max: float, down_ratio: float, seed: int) -> list[Peer]:
    """``n`` peers, uplinks log-uniform in [up_min, up_max] Mbit/s, ``round(nat·n)`` behind NAT."""
    rng = random.Random(seed)
    natted = set(rng.sample(range(n), round(nat * n)))
    peers = []
    for i in range(n):
        up = up_min if up_max <= up_min else math.exp(rng.uniform(math.log(up_min), math.log(up_max)))
        down = INF if down_ratio <= 0 else up * down_ratio
        key = hashlib.sha256(f"flowsim:{seed}:{i}".encode()).digest()  # a stand-in public key
        peers.append(Peer(peer_id_from_public_key(key), up * MBIT, down * MBIT, i not in natted))
    return peers


def lower_bound(size: int, learner_up: float, peers: list[Peer]) -> float:
    """max(W/B_learner, W/d_min, N·W/(B_learner + Σ uᵢ)): no scheme can deliver faster."""
    d_min = min((p.down for p in peers), default=INF)
    return max(size / learner_up, size / d_min, len(peers) * size / (learner_up + sum(p.up for p in peers)))


def plan_bound(plan: BroadcastPlan, size: int, up: dict[str, float]) -> float:
    """max over uploaders of (copies it forwards) · W / (its uplink)."""
    return max(plan.upload_copies(p) * size / up[p] for p in up)


def stripe_bytes(size: int, chunk: int, k: int) -> list[int]:
    """Bytes of each stripe: chunk i (the last one short) travels down stripe i mod k."""
    out = [0] * k
    for i in range(math.ceil(size / chunk)):
        out[i % k] += min(chunk, size - i * chunk)
    return out


def _water_fill(capacity: float, caps: list[float]) -> list[float]:
    """Max-min fair shares of ``capacity`` among flows each capped at ``caps[i]``."""
    share = [0.0] * len(caps)
    left, n = capacity, len(caps)
    for i in sorted(range(len(caps)), key=caps.__getitem__):
        share[i] = min(caps[i], left / n)
        left -= share[i]
        n -= 1
    return share


Edge = tuple[int, str, str]  # (stripe, parent, child)


def edge_rates(
    plan: BroadcastPlan, up: dict[str, float], down: dict[str, float], fed: bool = True
) -> dict[Edge, float]:
    """Each stream's steady rate (bytes/s): fair share of the parent's uplink, capped by the
    rate the parent receives that stripe (unless not ``fed``: the rate while a frame is in
    transit, what a child times) and by the child's downlink share; a fixed point."""
    out_edges: dict[str, list[Edge]] = {}
    n_in: dict[str, int] = {}
    for s in plan.stripes:
        for p, cs in s.children.items():
            for c in cs:
                out_edges.setdefault(p, []).append((s.index, p, c))
                n_in[c] = n_in.get(c, 0) + 1
    parent = {(s.index, c): p for s in plan.stripes for p, cs in s.children.items() for c in cs}
    rate: dict[Edge, float] = {}
    for _ in range(FIXED_POINT_ROUNDS):
        new: dict[Edge, float] = {}
        for p, edges in out_edges.items():
            caps = []
            for s, _p, c in edges:
                into = INF if p == plan.learner or not fed else rate.get((s, parent[(s, p)], p), INF)
                caps.append(min(into, down[c] / n_in[c]))
            new.update(zip(edges, _water_fill(up[p], caps)))
        if new == rate:
            break
        rate = new
    return rate


def pipeline(
    plan: BroadcastPlan, rate: dict[Edge, float], sizes: list[int], chunk: int, hop_s: float
) -> dict[tuple[int, str], tuple[float, float, float]]:
    """(start, first chunk, stripe done) of every (stripe, peer), pipelined by chunk."""
    times: dict[tuple[int, str], tuple[float, float, float]] = {}
    for s in plan.stripes:
        first, done = {plan.learner: 0.0}, {plan.learner: 0.0}
        queue = [plan.learner]
        for p in queue:
            for c in s.children.get(p, ()):
                r = rate[(s.index, p, c)]
                c_b = min(chunk, sizes[s.index])
                first[c] = first[p] + c_b / r + hop_s
                done[c] = max(first[p] + sizes[s.index] / r, done[p] + c_b / r) + hop_s
                times[(s.index, c)] = (first[p], first[c], done[c])
                queue.append(c)
    return times


def _received(t: float, start: float, done: float, size: int) -> float:
    """Bytes of a stripe held at ``t`` (linear between its start and its end)."""
    if t >= done:
        return size
    return max(0.0, size * (t - start) / max(done - start, 1e-12))


EARLIER_ASKED = 64
"""With ``Adoption.earlier``: how many members earlier in the stripe's order an orphan would ask
(those with the largest share first) after its ancestors."""


@dataclass(frozen=True)
class Adoption:
    """Which peers adopt an orphan. The defaults are the relay's rule (``broadcast/adoption.py``);
    the others are **what-ifs** the relay does not have (``--adopt-floor``, ``--adopt-earlier``)."""

    floor: float = 0.0
    """Ask a candidate (not the learner) only if its fair share of uplink for one more stream is at
    least this many times the orphan's planned rate: a slow ancestor would slow the orphan's
    whole subtree for the rest of the version, where a pull spreads over several sources."""
    earlier: bool = False
    """After the ancestors, ask members earlier in the stripe's breadth-first order (parent before
    child, earlier before later at a depth): streams that only go forward in that order cannot
    wait on each other in a cycle, so any of them may adopt, not only ancestors."""


def with_churn(
    plan: BroadcastPlan,
    times: dict[tuple[int, str], tuple[float, float, float]],
    sizes: list[int],
    chunk: int,
    peers: dict[str, Peer],
    up: dict[str, float],
    rate: dict[Edge, float],
    leave_at: dict[str, float],
    seed: int,
    adopt: bool = True,
    rule: Adoption = Adoption(),
) -> tuple[dict[tuple[int, str], float], int, int]:
    """Each remaining (stripe, peer)'s done time when the peers in ``leave_at`` leave then, how
    many stripe streams were recovered by pulls, and how many were adopted by an ancestor."""
    rng = random.Random(seed + 1)
    streams = {p: 0 for p in peers}
    for _s, p, _c in rate:
        if p != plan.learner:
            streams[p] += 1
    streams[plan.learner] = len(plan.stripes)
    live = dict.fromkeys(streams, 0)  # tree streams to peers that stay (an adopter's other load)
    for _s, p, c in rate:
        live[p] += c not in leave_at
    alive = [p for p in sorted(peers) if p not in leave_at]
    median_done = [statistics.median(times[(s.index, p)][2] for p in peers) for s in plan.stripes]
    parents = [s.parent_of() for s in plan.stripes]
    trees = []
    for s in plan.stripes:
        args = (plan, s.index, parents[s.index], times, sizes[s.index], chunk, peers, up, rate, leave_at, live)
        trees.append(_StripeChurn(*args, rule=rule))
        trees[-1].walk(adopt)
    # (stripe, peer) pulling -> when its stream stopped (a peer that leaves pulls nothing)
    cut = {(t.s, p): b for t in trees for p, b in t.broken.items() if p not in leave_at}
    pulled: dict[tuple[int, str], float] = {}
    # recovery sources: other parents of the peer plus PEERS_ASKED random members, all alive
    sources: dict[tuple[int, str], list[str]] = {}
    for s, node in cut:
        others = [parents[x.index].get(node, plan.learner) for x in plan.stripes if x.index != s]
        own = [p for p in dict.fromkeys(others) if p != plan.learner and p not in leave_at]
        asked = [p for p in rng.sample(alive, min(len(alive), PEERS_ASKED + 1)) if p != node][:PEERS_ASKED]
        srcs = own + [p for p in asked if peers[p].reachable]  # a NAT'd one cannot be dialled: skipped
        sources[(s, node)] = srcs or [plan.learner]
    no_churn = max(t[2] for t in times.values())
    busy = dict.fromkeys(cut, 1.0)  # share of the version each pull is in flight (first: all of it)
    for _ in range(LOAD_ROUNDS):
        load = dict.fromkeys(up, 0.0)
        for key, srcs in sources.items():
            for src in srcs:
                load[src] += busy[key] * IN_FLIGHT / len(srcs)
        for (s, node), broken in cut.items():
            per = [up[x] / (streams[x] + max(load[x], 1.0)) for x in sources[(s, node)]]
            r_rec = min(IN_FLIGHT * statistics.fmean(per), peers[node].down / len(plan.stripes))
            start, _first, end = times[(s, node)]
            pull_s = (sizes[s] - _received(broken, start, end, sizes[s])) / r_rec
            pulled[(s, node)] = max(broken + STALL_S + pull_s, median_done[s])
            busy[(s, node)] = min(1.0, pull_s / no_churn)
    done: dict[tuple[int, str], float] = {}
    for t in trees:
        got = t.finish({p: pulled.get((t.s, p), INF) for p in t.broken})
        done.update({(t.s, p): d for p, d in got.items() if p != plan.learner and p not in leave_at})
    return done, len(cut), sum(p not in leave_at for t in trees for p in t.adopted)


class _StripeChurn:
    """One stripe's tree under churn, top down (``broadcast/stripe_feed.py``): a peer whose parent
    left before the stripe had passed it hears nothing for ``STALL_S``, then is adopted by the
    first of those the relay asks (``adopters``) that stays until it is done, can be dialled (or
    is the learner), is not pulling and has room (``_full``): the rest of the stripe at a fair
    share of the adopter's uplink beside its streams to peers that stay, no faster than the
    adopter receives it. With no such peer it pulls. Every other peer follows its parent a
    chunk-time behind, a pulling one too (a stalled parent that answers a ping is waited for once
    more). ``adopt`` off (the relay before adoption): a cut peer and everyone under it pull."""

    def __init__(
        self,
        plan: BroadcastPlan,
        s: int,
        parent: dict[str, str],
        times: dict[tuple[int, str], tuple[float, float, float]],
        size: int,
        chunk: int,
        peers: dict[str, Peer],
        up: dict[str, float],
        rate: dict[Edge, float],
        leave_at: dict[str, float],
        live: dict[str, int],
        rule: Adoption = Adoption(),
    ) -> None:
        self.plan, self.s, self.parent, self.times, self.size, self.chunk = plan, s, parent, times, size, chunk
        self.peers, self.up, self.rate, self.leave_at, self.live, self.rule = peers, up, rate, leave_at, live, rule
        self.order: list[str] = []  # top down
        self.feed: dict[str, float] = {plan.learner: INF}  # the rate each peer receives this stripe at
        self.broken: dict[str, float] = {}  # peers pulling -> when their stream stopped
        self.adopted: dict[str, tuple[str, float, float]] = {}  # peer -> (adopter, rate, when cut)
        self.taken: dict[str, int] = {}  # adopter -> descendants and siblings (the learner: anyone) adopted
        self.nephews: dict[str, int] = {}  # relay -> nephews it adopted in this stripe

    def walk(self, adopt: bool) -> None:
        """Decide, top down, who follows its parent, who is adopted by whom, who pulls."""
        stripe = self.plan.stripes[self.s]
        queue = list(stripe.children.get(self.plan.learner, ()))
        for node in queue:
            queue.extend(stripe.children.get(node, ()))
            self.order.append(node)
            p = self.parent[node]
            left = self.leave_at.get(p, INF)
            cut_here = left < self.times[(self.s, node)][2]
            if not adopt and (p in self.broken or cut_here):
                self.broken[node] = min(self.broken.get(p, INF), left if cut_here else INF)
            elif cut_here and not self._adopt(node, left):
                self.broken[node] = left
            self.feed.setdefault(node, 0.0 if node in self.broken else min(self.rate[(self.s, p, node)], self.feed[p]))

    def finish(self, pulled: dict[str, float]) -> dict[str, float]:
        """Every peer's done time, given the pulling peers' (``pulled``)."""
        done = {self.plan.learner: 0.0}
        for node in self.order:
            p = self.parent[node]
            planned = self.times[(self.s, node)][2]
            if node in self.broken:
                done[node] = pulled[node]
            elif node in self.adopted:
                a, r, left = self.adopted[node]
                start, _first, end = self.times[(self.s, node)]
                rest = self.size - _received(left, start, end, self.size)
                done[node] = max(left + STALL_S + rest / r, done[a] + min(self.chunk, self.size) / r)
            elif p in self.leave_at:  # it had the stripe before its parent left
                done[node] = planned
            else:  # a delay upstream reaches it a chunk-time later
                done[node] = max(planned, done[p] + min(self.chunk, self.size) / self.rate[(self.s, p, node)])
        return done

    def _adopt(self, node: str, left: float) -> bool:
        """Adopt ``node`` (its parent left at ``left``) by the first candidate that may: those the
        relay asks (``adopters``), then, with ``rule.earlier``, the ``EARLIER_ASKED`` members
        earlier in the stripe's order with the largest share; with ``rule.floor``, only those whose
        share is at least that many times the orphan's planned rate (the learner always)."""
        need = self.rule.floor * self.rate[(self.s, self.parent[node], node)]
        ancestors = adopters(self.plan, self.s, node)
        if self._adopt_by(node, left, [a for a in ancestors if a == self.plan.learner or self._share(a) >= need]):
            return True
        if not self.rule.earlier:
            return False
        seen = {node, *ancestors}
        earlier = heapq.nlargest(EARLIER_ASKED, (a for a in self.order if a not in seen), key=self._share)
        return self._adopt_by(node, left, [a for a in earlier if self._share(a) >= need])

    def _share(self, a: str) -> float:
        """The rate ``a`` could stream one more adoptee this stripe at (before the adoptee's downlink)."""
        return min(
            self.up[a] / (self.live[a] + self.taken.get(a, 0) + self.nephews.get(a, 0) + 1), self.feed.get(a) or 0.0
        )

    def _full(self, a: str, node: str) -> bool:
        """``VersionState.adopt``: ``fanout`` descendants per stripe, ``adoption_slots`` others."""
        if is_nephew(self.parent, self.plan.learner, a, node):
            return self.nephews.get(a, 0) >= adoption_slots(self.plan, a)
        return self.taken.get(a, 0) >= self.plan.fanout

    def _adopt_by(self, node: str, left: float, candidates: list[str]) -> bool:
        """Adopt ``node`` by the first of ``candidates`` that may (see the class docstring)."""
        start, _first, end = self.times[(self.s, node)]
        rest = self.size - _received(left, start, end, self.size)
        for a in candidates:
            if self._full(a, node) or a in self.broken or not self.feed.get(a):
                continue
            r = min(self._share(a), self.peers[node].down / len(self.plan.stripes))
            stays = a == self.plan.learner or self.leave_at.get(a, INF) > left + STALL_S + rest / r
            if stays and (a == self.plan.learner or self.peers[a].reachable):
                counts = self.nephews if is_nephew(self.parent, self.plan.learner, a, node) else self.taken
                counts[a] = counts.get(a, 0) + 1
                self.adopted[node] = (a, r, left)
                self.feed[node] = r
                return True
        return False


def measured_versions(
    plain: list[PlanPeer], peers: list[Peer], learner_up: float, size: int, chunk: int, args: argparse.Namespace
) -> list[float]:
    """Seconds of ``--measured-versions`` + 1 versions without churn, the first planned without
    weights, each next one with the weights the real ``UplinkMeter`` holds from what every child
    would have reported (``BroadcastDone.streams``: per stripe, the bytes after the first chunk
    and the seconds their frames were in transit: at the parent's uplink share, capped by the
    child's downlink share, not by the parent's feed)."""
    from echorl.broadcast.uplinks import UplinkMeter
    from echorl.protocol.messages import BroadcastDone, ChunkRef, Manifest, StreamRate

    up = {p.peer_id: p.up for p in peers} | {LEARNER: learner_up}
    down = {p.peer_id: p.down for p in peers}
    refs = [ChunkRef.model_construct(size=min(chunk, size - i)) for i in range(0, size, chunk)]
    manifest = Manifest.model_construct(chunks=refs)
    meter, members, out = UplinkMeter(), plain, []
    for n_pub in range(args.measured_versions + 1):
        plan = plan_broadcast(LEARNER, members, args.fanout, args.seed)
        sizes = stripe_bytes(size, chunk, len(plan.stripes))
        times = pipeline(plan, edge_rates(plan, up, down), sizes, chunk, args.hop_ms / 1000)
        out.append(max(t[2] for t in times.values()))
        streams: dict[str, list[StreamRate]] = {}
        for (s, _parent, child), r in edge_rates(plan, up, down, fed=False).items():
            sent = sizes[s] - min(chunk, sizes[s])
            if sent > 0:
                streams.setdefault(child, []).append(StreamRate.model_construct(stripe=s, bytes=sent, seconds=sent / r))
        reports = {c: BroadcastDone.model_construct(ok=True, streams=v) for c, v in streams.items()}
        meter.note(plan, manifest, reports, n_pub)
        members = [replace(q, weight=meter.weight(q.peer_id)) if q.reachable or q.pushes else q for q in plain]
    return out


def _addr(i: int) -> str:
    """A distinct IPv4 listen address for member ``i`` (what a member announces: one addr)."""
    return f"/ip4/10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}/tcp/4001"


class AnnounceCost(NamedTuple):
    build_s: float  # learner CPU: members fitted to the frame, the announcement built, signed, encoded
    nbytes: int
    valid: bool  # within the message's limits (``MAX_PLAN_MEMBERS``)
    receive_s: float | None  # a node's CPU: decode, verify, plan (None: not valid)


def announce_cost(plan_peers: list[PlanPeer], size: int, chunk: int, fanout: int) -> AnnounceCost:
    """The real ``PlanAnnounce`` for these members: what it costs the learner to build and a node
    to take (both on worker threads in the code), and its size."""
    from pydantic import ValidationError

    from echorl.broadcast.members import announce_room, fit_addrs
    from echorl.broadcast.store import plan_of
    from echorl.protocol import wire
    from echorl.protocol.identity import Identity
    from echorl.protocol.messages import ChunkRef, Manifest, PlanAnnounce, PlanMember

    ident = Identity.generate()
    n_chunks = math.ceil(size / chunk)
    refs = [
        ChunkRef(digest=hashlib.sha256(i.to_bytes(8, "big")).digest(), size=min(chunk, size - i * chunk))
        for i in range(n_chunks)
    ]
    manifest = Manifest(
        run_id="flowsim", learner_peer_id=ident.peer_id, version=1, parent_version=0, kind="full",
        base_version=-1, chunk_bytes=chunk, payload_bytes=size, chunks=refs, tensors=[], result_bytes=size,
        result_digest=b"\0" * 32, created_at=0.0,
    )  # fmt: skip
    manifest = wire.sign(manifest, ident)
    t0 = time.process_time()
    members = [
        PlanMember(
            peer_id=p.peer_id,
            reachable=p.reachable,
            addrs=[_addr(i)],
            pushes=True if p.pushes else None,
            weight=p.weight,
        )
        for i, p in enumerate(plan_peers)
    ]
    members = fit_addrs(members, announce_room(manifest))
    fields = dict(
        run_id="flowsim", learner_peer_id=ident.peer_id, version=1, manifest=manifest, shape="striped",
        fanout=fanout, seed=0, learner_addrs=["/ip4/10.0.0.1/tcp/4001"], members=members, created_at=0.0,
    )  # fmt: skip
    valid = True
    try:
        ann = PlanAnnounce(**fields)
    except ValidationError:  # over MAX_PLAN_MEMBERS: the size it would have, unvalidated
        ann, valid = PlanAnnounce.model_construct(**fields), False
    encoded = wire.encode(wire.sign(ann, ident))
    build_s = time.process_time() - t0
    if not valid:
        return AnnounceCost(build_s, len(encoded), False, None)
    t0 = time.process_time()
    received = wire.decode(encoded, expect=PlanAnnounce)
    wire.verify(received, expected_signer=ident.peer_id)
    plan_of(received)
    return AnnounceCost(build_s, len(encoded), True, time.process_time() - t0)


def announce_spread(
    plan: BroadcastPlan, members: list[PlanPeer], up: dict[str, float], nbytes: int, receive_s: float
) -> tuple[int, float]:
    """The learner's own copies of the announcement and the seconds until the deepest member holds
    it, sent down stripe 0 as ``broadcast/announcing.py`` sends it in a steady swarm."""
    from echorl.broadcast.announcing import forward_flags

    parent = plan.stripes[0].parent_of()
    forwarded = forward_flags(plan, members, {m.peer_id for m in members}, parent)  # type: ignore[arg-type]
    direct = [m.peer_id for m in members if m.peer_id not in forwarded]
    arrival = {p: len(direct) * nbytes / up[plan.learner] + receive_s for p in direct}
    queue = list(direct)
    while queue:
        node = queue.pop()
        kids = [c for c in plan.stripes[0].children.get(node, ()) if c in forwarded]
        for c in kids:
            arrival[c] = arrival[node] + len(kids) * nbytes / up[node] + receive_s
        queue.extend(kids)
    return len(direct), max(arrival.values(), default=0.0)


class Delivery(NamedTuple):
    seconds: float  # until every remaining peer holds the version
    no_churn_s: float  # the same plan with nobody leaving
    pulled: int  # stripe streams cut and recovered chunk by chunk
    adopted: int  # stripe streams cut and completed by an adopting ancestor


def delivery(
    plan: BroadcastPlan,
    peers: list[Peer],
    learner_up: float,
    size: int,
    chunk: int,
    *,
    hop_s: float = 0.0,
    churn: float = 0.0,
    seed: int = 0,
    leave_at: dict[str, float] | None = None,
    adopt: bool = True,
    rule: Adoption = Adoption(),
) -> Delivery:
    """One version's delivery. ``leave_at`` (peer → time) fixes who leaves when; else a
    ``churn`` fraction leaves at uniform times in [0, the time without churn]. ``adopt`` off:
    every cut stream pulls (the relay before adoption)."""
    up = {p.peer_id: p.up for p in peers} | {plan.learner: learner_up}
    down = {p.peer_id: p.down for p in peers}
    rate = edge_rates(plan, up, down)
    sizes = stripe_bytes(size, chunk, len(plan.stripes))
    times = pipeline(plan, rate, sizes, chunk, hop_s)
    no_churn = max(t[2] for t in times.values())
    if leave_at is None and churn > 0:
        rng = random.Random(seed + 2)
        leaving = rng.sample(sorted(p.peer_id for p in peers), round(churn * len(peers)))
        leave_at = {p: rng.uniform(0, no_churn) for p in leaving}
    if not leave_at:
        return Delivery(no_churn, no_churn, 0, 0)
    by_id = {p.peer_id: p for p in peers}
    done, pulled, adopted = with_churn(plan, times, sizes, chunk, by_id, up, rate, leave_at, seed, adopt, rule)
    return Delivery(max(done.values()), no_churn, pulled, adopted)


def simulate(args: argparse.Namespace) -> dict:
    """One version, as the module docstring describes; the JSON fields of the report."""
    peers = draw_peers(args.peers, args.nat, args.uplink_mbps, args.uplink_max_mbps, args.down_ratio, args.seed)
    size = int(args.size_mb * 1024 * 1024)
    chunk = int(args.chunk_kb * 1024) or auto_chunk_bytes(size, len(peers), args.fanout)
    # a peer announced as a leaf (NodeInfo.leaf) is PlanPeer(reachable=False, pushes=False)
    slow = {p.peer_id for p in peers if p.up < args.leaf_below_mbps * MBIT}
    plain = [
        PlanPeer(
            p.peer_id, p.reachable and p.peer_id not in slow, not (p.reachable or args.nat_leaves or p.peer_id in slow)
        )
        for p in peers
    ]
    # the weights a learner holds after one version: each relay's upload as its children timed it
    weighted = [replace(q, weight=weight_of(p.up)) if q.reachable or q.pushes else q for q, p in zip(plain, peers)]
    plan_peers = plain if args.no_weights else weighted
    learner_up = (args.learner_mbps or args.uplink_mbps) * MBIT
    up = {p.peer_id: p.up for p in peers} | {LEARNER: learner_up}
    bound = lower_bound(size, learner_up, peers)

    def run(members: list[PlanPeer]) -> tuple[BroadcastPlan, float, tuple[float, float, int]]:
        t0 = time.process_time()
        plan = plan_broadcast(LEARNER, members, args.fanout, args.seed)
        built = time.process_time() - t0
        hop = args.hop_ms / 1000
        rule = Adoption(args.adopt_floor, args.adopt_earlier)
        return (
            plan,
            built,
            delivery(plan, peers, learner_up, size, chunk, hop_s=hop, churn=args.churn, seed=args.seed, rule=rule),
        )

    plan, plan_build_s, (predicted, no_churn, recovered, adopted) = run(plan_peers)
    out = {
        "peers": len(peers),
        "nat_peers": sum(not p.reachable for p in peers),
        "churn": args.churn,
        "bytes": size,
        "chunk_bytes": chunk,
        "fanout": args.fanout,
        "weights": "none" if args.no_weights else "uplink",
        "depth": plan.depth,
        "uplink_mbps": [args.uplink_mbps, max(args.uplink_mbps, args.uplink_max_mbps)],
        "learner_mbps": learner_up / MBIT,
        "predicted_s": round(predicted, 3),
        "predicted_no_churn_s": round(no_churn, 3),
        "lower_bound_s": round(bound, 3),
        "ratio": round(predicted / bound, 3),
        "plan_bound_s": round(plan_bound(plan, size, up), 3),
        "streams_recovered": recovered,
        "streams_adopted": adopted,
        "adopt_floor": args.adopt_floor,  # what-ifs (Adoption): 0 and false are the relay's rule
        "adopt_earlier": args.adopt_earlier,
        "plan_build_s": round(plan_build_s, 3),
    }
    if not (args.no_weights or args.no_baseline):  # the same peers with every relay given k slots
        base, _, (b_predicted, *_) = run(plain)
        out.update(
            {
                "baseline_ratio": round(b_predicted / bound, 3),
                "baseline_predicted_s": round(b_predicted, 3),
                "baseline_depth": base.depth,
                "baseline_plan_bound_s": round(plan_bound(base, size, up), 3),
            }
        )
    if args.churn > 0:  # the same plan and departures, every cut stream pulling (before adoption)
        hop = args.hop_ms / 1000
        pulls = delivery(plan, peers, learner_up, size, chunk, hop_s=hop, churn=args.churn, seed=args.seed, adopt=False)
        out.update(
            {"no_adoption_predicted_s": round(pulls.seconds, 3), "no_adoption_ratio": round(pulls.seconds / bound, 3)}
        )
    if args.measured_versions > 0:  # the weights the learner measures, version after version
        seconds = measured_versions(plain, peers, learner_up, size, chunk, args)
        out["measured_ratios"] = [round(t / bound, 3) for t in seconds]
    if not args.no_announce:
        cost = announce_cost(plan_peers, size, chunk, args.fanout)
        sends, spread = announce_spread(plan, plan_peers, up, cost.nbytes, cost.receive_s or 0.0)
        out.update(
            {
                "announce_s": round(cost.build_s, 3),
                "announce_bytes": cost.nbytes,
                "announce_within_limits": cost.valid,
                "announce_receive_s": None if cost.receive_s is None else round(cost.receive_s, 3),
                "announce_sends": sends,
                "announce_upload_s": round(sends * cost.nbytes / learner_up, 3),
                # the baseline: the learner sends each member its own copy
                "announce_upload_direct_s": round(len(plan_peers) * cost.nbytes / learner_up, 3),
                "announce_spread_s": round(spread, 3),
            }
        )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--nat", type=float, default=0.5, help="fraction of peers behind NAT (they push)")
    ap.add_argument("--nat-leaves", action="store_true", help="NAT'd peers are plain leaves (no push)")
    ap.add_argument(
        "--leaf-below-mbps",
        type=float,
        default=0.0,
        help="announce peers with a slower uplink as leaves (NodeInfo.leaf)",
    )
    ap.add_argument("--churn", type=float, default=0.0, help="fraction of peers leaving during the version")
    ap.add_argument("--size-mb", type=float, default=1024.0, help="version size in MiB")
    ap.add_argument("--chunk-kb", type=float, default=0.0, help="0: auto_chunk_bytes (the learner's default)")
    ap.add_argument("--fanout", type=int, default=4)
    ap.add_argument("--uplink-mbps", type=float, default=5.0, help="lowest peer uplink (Mbit/s)")
    ap.add_argument("--uplink-max-mbps", type=float, default=100.0, help="highest; equal or lower: all the same")
    ap.add_argument("--learner-mbps", type=float, default=100.0, help="0: the lowest peer uplink")
    ap.add_argument("--down-ratio", type=float, default=10.0, help="downlink / uplink (0: unlimited)")
    ap.add_argument("--hop-ms", type=float, default=0.0, help="one-way latency per plan edge")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-announce", action="store_true", help="skip measuring the announcement")
    ap.add_argument("--no-weights", action="store_true", help="every relay k slots (no uplink weights)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unweighted plan's figures")
    ap.add_argument(
        "--measured-versions",
        type=int,
        default=0,
        help="also plan V more versions with the weights the learner measures (UplinkMeter), without churn",
    )
    ap.add_argument(
        "--adopt-floor",
        type=float,
        default=0.0,
        help="what-if, not the relay's rule: an orphan asks only adopters whose uplink share is at least "
        "this many times its planned rate (0: the relay's rule)",
    )
    ap.add_argument(
        "--adopt-earlier",
        action="store_true",
        help="what-if, not the relay's rule: after its ancestors an orphan asks members earlier in the "
        "stripe's breadth-first order",
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.peers < 1 or not 0 <= args.nat <= 1 or not 0 <= args.churn < 1 or args.size_mb <= 0:
        ap.error("need --peers >= 1, 0 <= --nat <= 1, 0 <= --churn < 1, --size-mb > 0")
    if args.uplink_mbps <= 0 or args.fanout < 1:
        ap.error("need --uplink-mbps > 0 and --fanout >= 1")
    return args


if __name__ == "__main__":
    a = parse_args()
    emit(simulate(a), a.json)
