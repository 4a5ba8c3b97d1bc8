"""Sampling by the swarm (``echorl serve --swarm``): the service is also a learner peer, and a
sampling client's requests become leases that volunteer nodes serve, verified as rollouts are.

How a request travels (docs/service.md, "Sampling by the swarm"):

1. **Snapshots are versions.** A sampler snapshot of the swarm's adapter shape
   (``--swarm-lora-rank``, the attention, MLP and unembedding projections: the Tinker client's
   defaults) is published through the broadcast as an adapter version over the base this server
   holds (version 0: the bare base, a zero adapter). Nodes apply it to their own copy of the base
   (``node/adapters.py``).
2. **Exact weights, in turns.** The swarm's staleness bound is 0: nodes hold one version, the
   newest, and only requests for its snapshot are leased. Requests for another snapshot (another
   session's, or an older one) wait for their turn: once every leased request is done, the oldest
   waiting request's snapshot is published as the next version and all requests for it are leased.
   A new snapshot is published at once while nothing is leased. The server samples a request with
   a seed, another temperature, top-p, prompt log-probs, more than ``--swarm-max-tokens``, a prompt
   over ``MAX_PROMPT_TOKENS`` or another adapter shape, and every request while no node is active.
3. **Tokens in the lease.** A request of n samples is ⌈n/G⌉ prompts of G samples (the lease's
   group size), each carrying the prompt's token ids (``LeasePrompt.token_ids``). Nodes sample to
   EOS or ``--swarm-max-tokens``; the request's own ``max_tokens`` and stops cut each sample
   afterwards (:func:`cut`), which is exact: sampling is left to right, so a prefix is the sample
   the shorter request would have drawn.
4. **The same checks.** Submissions go through ``LearnerService`` unchanged: signature, lease,
   completion bounds, the spot check's log-prob recomputation and seeded replay (default: every
   submission, ``--spot-check-fraction 1``), receipts. Samples reach the client only from an
   accepted submission; a refused one's prompts are leased again.
5. **Bounded wait.** A request not complete after ``--swarm-wait-s`` (leased or still waiting for
   its turn) is finished by the server: the missing samples are sampled there and the request's
   late prompts withdrawn (a late group is refused as unknown, unpaid).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from echorl.actor.types import RolloutGroup, SamplingParams
from echorl.protocol import limits
from echorl.tasks.base import Prompt, Task

from .wire import Sequence

if TYPE_CHECKING:
    from echorl.learner.service import LearnerService
    from echorl.protocol.identity import Identity

    from .config import ServeConfig
    from .engine import Engine, LoraSpec, Snapshot

log = logging.getLogger(__name__)
TICK_S = 0.25
"""How often waiting requests are held against their deadline."""
KEEP_SNAPSHOTS = 16
"""Snapshots kept for a turn (references to the sessions' own tensors; the oldest goes first)."""

Done = Callable[[list[Sequence], int], None]
"""A request's end: the sequences nodes sampled (cut to the request) and how many are missing."""


def cut(tokens: list[int], logprobs: list[float], params: SamplingParams, stop_tokens: set[int], decode) -> Sequence:
    """A node's sample cut to the request: at its ``max_tokens`` (``length``), after an EOS or a
    stop token, or after the token that completes a stop string (``stop``), as the server's own
    sampler stops (``TorchBackend.sample_ids``, ``Engine.sample``). It runs on the event loop, so
    a stop string costs one decode, and a binary search over prefixes only when the sample holds
    one (a prefix's text grows with the prefix: the first that holds it is the server's stop)."""
    n = min(len(tokens), params.max_new_tokens)
    end = next((i + 1 for i, t in enumerate(tokens[:n]) if t in stop_tokens), None)
    holds = lambda k: any(w in decode(tokens[:k]) for w in params.stop)
    if params.stop and holds(end or n):
        lo, hi = 1, end or n
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
        end = lo
    if end is not None:
        return Sequence(tokens=list(tokens[:end]), logprobs=list(logprobs[:end]), stop_reason="stop")
    return Sequence(tokens=list(tokens[:n]), logprobs=list(logprobs[:n]), stop_reason="length")


@dataclass
class SwarmRequest:
    """One sampling request out to the swarm."""

    ident: str
    key: int  # the snapshot it samples (``Swarm.key_of``)
    prompt: list[int]
    n: int
    params: SamplingParams
    stop_tokens: set[int]
    deadline: float  # trio clock: then the server samples what is missing
    done: Done
    version: int = -1  # the version its prompts were leased at; -1: waiting for its snapshot's turn
    prompt_ids: set[str] = field(default_factory=set)
    samples: list[tuple[list[int], list[float]]] = field(default_factory=list)


class RequestQueue(Task):
    """The lease service's prompt source: the prompts of waiting requests, oldest first (it runs
    dry; the service then tells nodes to ask again soon). Nothing is scored: a sample's worth is
    the client's business, its honesty the spot check's."""

    name = "serve"

    def __init__(self) -> None:
        super().__init__()
        self.waiting: deque[Prompt] = deque()

    def next_prompts(self, n: int) -> list[Prompt]:
        return [self.waiting.popleft() for _ in range(min(n, len(self.waiting)))]

    def withdraw(self, prompt_ids: set[str]) -> None:
        if any(p.prompt_id in prompt_ids for p in self.waiting):
            self.waiting = deque(p for p in self.waiting if p.prompt_id not in prompt_ids)

    def eval_prompts(self) -> list[Prompt]:
        return []


class Swarm:
    """The service's learner peer (see the module docstring). ``version`` is the newest published
    version, ``current`` the snapshot it holds; :meth:`offer` keeps a snapshot for its turn,
    :meth:`takes` says whether a request goes to the swarm, :meth:`submit` takes it."""

    def __init__(self, cfg: ServeConfig, engine: Engine, identity: Identity) -> None:
        from echorl.actor import lora
        from echorl.rl.buffer import StalenessBuffer

        lora.weight_files(engine.model_dir)  # nodes check the base by its digest: safetensors only, said now
        self.cfg, self.engine, self.identity = cfg, engine, identity
        self.spec: LoraSpec = engine.lora_spec(cfg.swarm_lora_rank, cfg.lora_alpha, 0, True, True, True)
        self.version = 0
        self.current = 0  # the snapshot (key) the newest version holds: 0, the bare base, at start
        self.queue = RequestQueue()
        self.buffer = StalenessBuffer(0, consumer=self._deliver)
        self.requests: dict[str, SwarmRequest] = {}  # in arrival order: turns go oldest first
        self._by_prompt: dict[str, SwarmRequest] = {}
        self._snaps: dict[int, dict[str, Any]] = {}  # key -> adapter tensors that may take a turn
        self.service: LearnerService | None = None
        self._publisher: Any = None
        self.counters = {"requests_swarm": 0, "requests_finished_by_server": 0, "samples_from_nodes": 0, "turns": 0}

    # --- the event loop's side ----------------------------------------------------------------
    @staticmethod
    def key_of(snap: Snapshot) -> int:
        """A snapshot's key: its ident (0: the bare base)."""
        return snap.ident if snap.tensors is not None else 0

    def _fits(self, snap: Snapshot) -> bool:
        return snap.tensors is None or (snap.spec is not None and snap.spec.key() == self.spec.key())

    def offer(self, snap: Snapshot) -> None:
        """A new snapshot a request may name: kept for its turn, and published at once while the
        swarm has nothing leased (so nodes hold it before its requests come)."""
        if self._publisher is None or not self._fits(snap) or snap.tensors is None:
            return
        self._snaps[self.key_of(snap)] = snap.tensors
        in_use = {0, self.current} | {r.key for r in self.requests.values()}
        spare = [k for k in self._snaps if k not in in_use]
        for k in spare[: max(0, len(self._snaps) - KEEP_SNAPSHOTS)]:  # the oldest no request names
            del self._snaps[k]
        if not self._busy():
            self._publish(self.key_of(snap))

    def takes(self, snap: Snapshot, prompt: list[int], params: SamplingParams, seed: int | None, plp: bool) -> bool:
        """Whether the swarm samples this request (module docstring, 2)."""
        service = self.service
        if service is None or not service.peers.has_active() or self.key_of(snap) not in self._snaps:
            return False
        if len(self.requests) >= self.cfg.queue_size:  # as many as the server's own queue holds
            return False
        if seed is not None or plp or params.top_p != 1.0 or params.temperature != self.cfg.swarm_temperature:
            return False
        return params.max_new_tokens <= self.cfg.swarm_max_tokens and len(prompt) <= limits.MAX_PROMPT_TOKENS

    def submit(
        self,
        ident: str,
        snap: Snapshot,
        prompt: list[int],
        n: int,
        params: SamplingParams,
        stop_tokens: list[int],
        done: Done,
    ) -> None:
        """Take a request the swarm :meth:`takes` (leased now if its snapshot holds the turn and no
        other waits, else at its turn); ``done`` is called once, on the event loop."""
        eos = getattr(self.engine.tokenizer, "eos_token_id", None)
        stops = set(stop_tokens) | ({eos} if isinstance(eos, int) else set(eos or ()))
        deadline = trio.current_time() + self.cfg.swarm_wait_s
        req = SwarmRequest(ident, self.key_of(snap), list(prompt), n, params, stops, deadline, done)
        others = any(r.version < 0 for r in self.requests.values())
        self.requests[ident] = req
        self.counters["requests_swarm"] += 1
        if req.key == self.current and not others:
            self._lease(req)
        self._turn()

    def _lease(self, req: SwarmRequest) -> None:
        """Queue a request's prompts (⌈n/G⌉, its token ids) at the current version."""
        req.version = self.version
        for j in range(math.ceil(req.n / self.cfg.group_size)):
            p = Prompt(prompt_id=f"{req.ident}.{j}", text="", token_ids=req.prompt)
            req.prompt_ids.add(p.prompt_id)
            self._by_prompt[p.prompt_id] = req
            self.queue.waiting.append(p)

    def _busy(self) -> bool:
        """Whether requests leased at the current version are unfinished (the turn is theirs)."""
        return any(r.version == self.version for r in self.requests.values())

    def _turn(self) -> None:
        """Once the current snapshot's requests are done: the oldest waiting request's snapshot takes
        the turn (published as the next version unless it holds it) with every request for it."""
        if self._busy():
            return
        waiting = [r for r in self.requests.values() if r.version < 0]
        if not waiting:
            return
        key = waiting[0].key
        if key != self.current:
            self._publish(key)
        for r in waiting:
            if r.key == key:
                self._lease(r)

    def _publish(self, key: int) -> None:
        """``key``'s adapter as the next version (a small broadcast: the adapter alone)."""
        self.version += 1
        self.current = key
        self.counters["turns"] += 1
        log.debug("snapshot %d takes the turn as v%d", key, self.version)
        self._publisher.offer(self.version, dict(self._snaps[key]))  # written to its file in a worker thread

    def _deliver(self, group: RolloutGroup) -> None:
        """An accepted group (``StalenessBuffer``'s consumer): its samples go to its request."""
        req = self._by_prompt.pop(group.prompt_id, None)
        if req is None or req.ident not in self.requests:
            return
        req.prompt_ids.discard(group.prompt_id)
        req.samples.extend((list(s.token_ids), list(s.logprobs)) for s in group.samples)
        if len(req.samples) >= req.n:
            self._finish(req)

    def _finish(self, req: SwarmRequest) -> None:
        """End a request: the node samples it has (cut to it), the rest to be sampled by the server."""
        del self.requests[req.ident]
        for pid in req.prompt_ids:
            self._by_prompt.pop(pid, None)
        self.queue.withdraw(req.prompt_ids)
        self.buffer.withdraw(req.prompt_ids)
        decode = self._decode
        seqs = [cut(t, lp, req.params, req.stop_tokens, decode) for t, lp in req.samples[: req.n]]
        self.counters["samples_from_nodes"] += len(seqs)
        if len(seqs) < req.n:
            self.counters["requests_finished_by_server"] += 1
        req.done(seqs, req.n - len(seqs))
        self._turn()

    def _decode(self, tokens: list[int]) -> str:
        return str(self.engine.tokenizer.decode(tokens, skip_special_tokens=True))

    async def _expire(self) -> None:
        """Forever: requests past their wait (leased or waiting for their turn) are finished by
        the server."""
        while True:
            await trio.sleep(TICK_S)
            now = trio.current_time()
            for req in [r for r in self.requests.values() if r.deadline <= now]:
                if req.ident in self.requests:  # (a finish may start the next turn, never end another)
                    self._finish(req)

    def metrics(self) -> dict[str, Any]:
        """Requests taken, finished by the server, samples from nodes, turns, the version."""
        out: dict[str, Any] = {
            **self.counters,
            "swarm_version": self.version,
            "swarm_requests_waiting": len(self.requests),
        }
        if self.service is not None:
            out["swarm_nodes"] = len(self.service.active_peers())
        return out

    # --- the peer -----------------------------------------------------------------------------
    async def run(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Host, DHT record, broadcaster, lease service and the zero adapter as version 0, until
        cancelled; ``task_status`` gets the bootstrap address nodes join."""
        from echorl.broadcast.broadcaster import Broadcaster
        from echorl.learner.peers import PeerBook
        from echorl.learner.publish import Publisher
        from echorl.learner.service import LearnerService
        from echorl.net.host import HostConfig, open_host
        from echorl.net.membership import Membership
        from echorl.net.transport import UploadLimiter
        from echorl.protocol.messages import SamplingSpec

        cfg = self.cfg
        scratch, adapter, zero = await trio.to_thread.run_sync(self._scratch)
        async with open_host(self.identity, HostConfig(listen=cfg.listen, announce=tuple(cfg.announce))) as host:
            book = PeerBook()
            bc = Broadcaster(
                host,
                self.identity,
                cfg.run_id,
                upload_limit=UploadLimiter.from_mbps(cfg.upload_mbps),
                announce_timeout_s=5.0,
                done_timeout_s=cfg.swarm_broadcast_timeout_s,
                retain=1,
                cache_bytes=int(cfg.chunk_cache_mb * 2**20),
                admit=lambda pid: book.is_member(pid),
                adapter=adapter,
            )
            spot = self._spot_checker(scratch, bc.version_bytes) if cfg.spot_check_fraction > 0 else None
            sampling = SamplingSpec(
                temperature=cfg.swarm_temperature, top_p=1.0, max_new_tokens=cfg.swarm_max_tokens, stop=[]
            )
            service = LearnerService(
                self.identity,
                cfg.run_id,
                self.queue,
                self.engine.tokenizer,
                self.buffer,
                cfg,
                int(self.engine.config.vocab_size),
                sampling=sampling,
                version=lambda: self.version,
                spot=spot,
                incarnation=bc.incarnation,
                peers=book,
                holds_versions=True,  # turns: no version is published while a request is leased
                summary=self.metrics,  # the swarm's figures in its status (echorl status --bootstrap)
            )
            service.install(host)
            membership = Membership(host, cfg.run_id, server=True)
            membership.pin(host.peer_id)
            async with trio.open_nursery() as nursery:
                bc.install()
                await nursery.start(bc.run)
                publisher = Publisher(bc, service, timeout_s=cfg.swarm_broadcast_timeout_s)
                self._snaps[0] = zero
                await publisher.publish(0, zero)
                nursery.start_soon(publisher.run)
                await nursery.start(membership.run)
                await membership.publish_learner_record(host.addrs)
                nursery.start_soon(service.maintain)
                nursery.start_soon(self._expire)
                self.service, self._publisher = service, publisher
                task_status.started(host.addrs[0])

    def _scratch(self) -> tuple[Any, Any, dict[str, Any]]:
        """The spot checker's model (a second copy of the base with the swarm's adapter, as a node
        builds it), the ``AdapterSpec`` every manifest names, and the zero adapter (version 0)."""
        from echorl.actor import lora
        from echorl.actor.backend import TorchBackend

        model_dir = Path(self.engine.model_dir)
        base = TorchBackend.from_pretrained(model_dir, device=self.cfg.device, dtype="float32").model
        settings = lora.LoraSettings(self.spec.rank, self.spec.alpha, 0.0, self.spec.targets)
        model = lora.attach(base, settings).eval().requires_grad_(False)
        zero = {k: v.zero_() if ".lora_B." in k else v for k, v in lora.adapter_state(model).items()}
        return model, lora.adapter_spec(model, lora.base_digest(model_dir)), zero

    def _spot_checker(self, scratch: Any, snapshots: Any) -> Any:
        from echorl.learner.spot_check import SpotChecker

        cfg = self.cfg
        return SpotChecker(
            lambda: scratch,
            self.engine.tokenizer,
            cfg.swarm_temperature,
            cfg.spot_check_fraction,
            snapshots,
            tolerance_mean=cfg.spot_check_tolerance_mean,
            tolerance_max=cfg.spot_check_tolerance_max,
        )
