"""``echorl node``: the volunteer node daemon: join with a signed capability record, receive
weights through the learner's broadcast (a relay that also forwards chunks to its plan children;
``node/versions.py``), then lease → generate (in a worker thread) → submit signed rollouts,
forever. A node refused for old weights waits for the broadcast in flight, then catches up from
peers, then fetches directly from the learner.

Addresses are checked before the model loads (a bad one: one line, exit 2). Reconnects with
exponential backoff (plus jitter, at most 15 s) when the learner is unreachable, saying why
(refused, timed out, wrong peer id); gives up with exit 1 after ``--give-up-after`` seconds
without the learner. A learner that refuses the key as already in use (``identity_in_use``) ends
the node at once (exit 2). When the run is over the learner answers ``RunEnded``: the node logs
its contribution and exits 0. On SIGTERM or SIGINT it returns the lease it holds (so its prompts
are re-queued at once), writes its newest version to disk and exits 0.

The newest verified version is kept in ``--state-dir`` (``node/state.py``); a restart with
the same key starts from it, after verifying it against the pinned learner and the run.

Each accepted submission comes back with the learner's signed receipt; the node verifies it and
appends it to ``--receipts`` (``node/receipts.py``). ``--metrics-port`` serves the node's counters
(``NodeState.row``) as Prometheus ``/metrics`` (docs/metrics.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from echorl import config
from echorl.node.config import NodeConfig
from echorl.protocol.identity import short_id

log = logging.getLogger("echorl.node.daemon")


def add_arguments(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p, NodeConfig)


@dataclass
class NodeState:
    run_id: str
    learner: str = ""  # learner peer id (pinned: it signs the manifests)
    leases_done: int = 0
    current_lease: str = ""
    weights: Any = None  # NodeWeights
    allow_env: tuple[str, ...] = ()  # user environments (module:Class) this node agreed to run
    envs: dict[str, Any] = field(default_factory=dict)  # built environments by (spec, options)
    membership: Any = None  # Membership (our DHT server)
    receipts: Any = None  # ReceiptLog
    sinks: list[Any] = field(default_factory=list)
    groups_generated: int = 0
    tokens_generated: int = 0
    generate_seconds: float = 0.0
    groups_credited: int = 0
    receipts_kept: int = 0
    receipts_invalid: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # error code -> submissions refused
    instance: bytes = b""  # random per process: the learner refuses a second live process with our key
    last_contact: float = 0.0  # monotonic time the learner last answered
    ended: Any = None  # the learner's RunEnded, once the run is over

    def row(self) -> dict[str, Any]:
        """The node's metrics, computed here only (sinks just export them)."""
        return {"version": self.weights.version if self.weights is not None else -1,
                "leases_done": self.leases_done, "groups_generated": self.groups_generated,
                "tokens_generated": self.tokens_generated, "generate_seconds": self.generate_seconds,
                "groups_credited": self.groups_credited, "receipts": self.receipts_kept,
                "receipts_invalid": self.receipts_invalid, "submissions_rejected_by_reason": dict(self.rejected)}

    def publish(self) -> None:
        row = self.row()
        for sink in self.sinks:
            sink.write(row)


class NodeExit(Exception):
    """Ends the node with ``code`` and a one-line ``message`` (no traceback)."""

    def __init__(self, code: int, message: str) -> None:
        self.code = code
        super().__init__(message)


class RunOver(Exception):
    """The learner said the run is over (``state.ended`` holds its signed ``RunEnded``)."""


def run(args: argparse.Namespace) -> int:
    cfg = config.configured(NodeConfig, args, "node")
    if isinstance(cfg, int):
        return cfg
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node %(levelname)s %(message)s", stream=sys.stderr)
    try:
        device = _check(cfg)
    except ValueError as exc:
        config.fail("node", exc)
        return 2
    log.info("node device: %s, engine %s", device, cfg.engine)
    signal.signal(signal.SIGTERM, _outside_trio_signal)  # trio's receiver restores this on exit
    try:
        trio.run(main, cfg)
    except KeyboardInterrupt:
        return 130
    except NodeExit as exc:
        print(f"echorl node: {exc}", file=sys.stderr)
        return exc.code
    return 0


def _check(cfg: NodeConfig) -> str:
    """Refuse what cannot work before anything heavy loads: a model path that is not an HF
    directory, a missing engine, CUDA asked for where there is none. Returns the device's name."""
    import importlib.util

    _check_addresses(cfg)
    from echorl.metrics_sinks import sink_flags_error

    cfg.check_model()
    cfg.key = os.path.expanduser(cfg.key)
    if problem := sink_flags_error(cfg.metrics_port):
        raise config.ConfigError(problem)
    if cfg.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise config.ConfigError("vllm is not installed: pip install 'echorl[vllm]' on a CUDA machine")
    device = cfg.pin_device()
    if cfg.engine == "vllm" and cfg.device != "cuda:0":
        raise config.ConfigError(f"--engine vllm runs on cuda:0 (choose the GPU with CUDA_VISIBLE_DEVICES), "
                                 f"not {cfg.device}")
    return device


def _check_addresses(cfg: NodeConfig) -> None:
    """Every address the user gave, checked before anything slow happens (AddressError)."""
    from echorl.net.addrs import parse_announce, parse_listen, parse_peer_addr

    cfg.bootstrap = parse_peer_addr(cfg.bootstrap)
    cfg.listen = parse_listen(cfg.listen)
    cfg.announce = [parse_announce(a) for a in cfg.announce]
    if cfg.learner_id:
        parse_peer_addr(f"/ip4/127.0.0.1/tcp/1/p2p/{cfg.learner_id}", "--learner-id")


def _capability(cfg: NodeConfig, tokens_per_s: float, addrs: list[str]) -> Any:
    from echorl.protocol.messages import Capability

    import torch

    if cfg.device.startswith("cuda"):
        device = torch.cuda.get_device_name(torch.device(cfg.device))
        memory = int(torch.cuda.get_device_properties(torch.device(cfg.device)).total_memory)
    else:
        device = "cpu"
        memory = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return Capability(engine=cfg.engine, device=device, memory_bytes=memory, tokens_per_s=float(tokens_per_s),
                      price_per_hour=float(cfg.price_per_hour), reachable=True, listen_addrs=addrs[:16],
                      dtype=cfg.dtype)


def _load_backend(cfg: NodeConfig) -> tuple[Any, float]:
    """The inference backend (``InferenceBackend``: version, load_state_dict, generate) and its
    measured tokens/s. vLLM is imported only when chosen; that path is untested here (no GPU)."""
    import torch

    from echorl.actor.backend import measure_tokens_per_second
    from echorl.actor.model import default_model

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    path = cfg.model or str(default_model())
    if cfg.engine == "vllm":
        from echorl.actor.vllm_backend import VLLMBackend

        backend: Any = VLLMBackend(path, gpu_memory_utilization=cfg.vllm_gpu_memory, dtype=cfg.dtype, seed=cfg.seed)
    else:
        from echorl.actor.backend import TorchBackend

        backend = TorchBackend.from_pretrained(path, device=cfg.device, dtype=cfg.dtype)
    return backend, measure_tokens_per_second(backend)


async def main(cfg: NodeConfig) -> None:
    from echorl.protocol.identity import load_or_create_identity

    from echorl.net.host import HostConfig, open_host
    from echorl.net.membership import Membership
    from echorl.metrics_sinks import open_sinks
    from echorl.node.receipts import ReceiptLog
    from echorl.node.state import SnapshotKeeper, default_state_dir, lock_state_dir
    from echorl.node.versions import NodeWeights
    from echorl.net.transport import UploadLimiter

    identity = load_or_create_identity(cfg.key)
    state_dir = Path(cfg.state_dir).expanduser() if cfg.state_dir else default_state_dir(cfg.key, cfg.run_id)
    lock = lock_state_dir(state_dir)  # held until this process ends
    if lock is None:
        raise NodeExit(2, f"another node process with this key or state directory runs on this machine "
                          f"({state_dir} is locked); give each node its own --key")
    backend, tps = await trio.to_thread.run_sync(_load_backend, cfg)
    log.info("node %s: %.0f tokens/s on %s (%s)", short_id(identity.peer_id), tps, cfg.device, cfg.dtype)
    import secrets

    state = NodeState(run_id=cfg.run_id, allow_env=tuple(cfg.allow_env),
                      receipts=ReceiptLog(Path(cfg.receipts).expanduser() if cfg.receipts else state_dir / "receipts.jsonl"),
                      instance=secrets.token_bytes(16), last_contact=time.monotonic())
    fatal: NodeExit | None = None  # raised once every nursery is closed (no exception group)
    try:
        state.sinks = open_sinks("node", cfg.metrics_port)
    except OSError as exc:
        raise SystemExit(f"echorl node: --metrics-port {cfg.metrics_port}: {exc}") from None
    log.info("receipts go to %s", state.receipts.path)
    async with open_host(identity, HostConfig(listen=cfg.listen, announce=tuple(cfg.announce))) as host:
        cap = _capability(cfg, tps, host.addrs)
        state.weights = NodeWeights(host, cfg.run_id, backend, UploadLimiter.from_mbps(cfg.upload_mbps),
                                    keeper=SnapshotKeeper(state_dir, cfg.run_id),
                                    cache_bytes=int(cfg.chunk_cache_mb * 2**20))
        async with trio.open_nursery() as nursery:
            state.membership = Membership(host, cfg.run_id, server=True)
            await nursery.start(state.membership.run)
            stop = trio.Event()
            nursery.start_soon(_wait_signal, stop)
            with trio.CancelScope() as work:
                nursery.start_soon(_cancel_when, stop, work)
                try:
                    await _work_forever(host, cfg, state, cap, nursery)
                except NodeExit as exc:
                    fatal = exc
            _Shutdown.draining = True  # from here on the node is leaving, signal or not
            await _return_lease(host, state)
            with trio.move_on_after(120):
                await state.weights.flush()  # the newest version on disk before we go
            nursery.cancel_scope.cancel()
    log.info("node stopped after %d leases (versions loaded: %s; started from on-disk v%d); %d receipts for %d "
             "groups in %s", state.leases_done, state.weights.loads, state.weights.started_from, state.receipts_kept,
             state.groups_credited, state.receipts.path)
    for sink in state.sinks:
        sink.close()
    if state.ended is not None:
        e = state.ended
        print(f"echorl node: run {e.run_id} is over (final version {e.version}, {e.steps} steps); this node "
              f"contributed {e.leases_done} leases, {e.groups_accepted} rollout groups accepted", file=sys.stderr)
    if fatal is not None:
        raise fatal


class _Shutdown:
    """Set once the node is leaving: a SIGTERM that lands after the signal receiver closed (while
    leases are returned, the snapshot flushed, the host closed) is then ignored instead of killing
    the process mid-cleanup with the default action."""

    draining = False


def _outside_trio_signal(signum: int, frame: Any) -> None:
    """SIGTERM while no receiver listens: before start-up finished it stops the node like
    Ctrl-C; once the node is leaving anyway it changes nothing."""
    if not _Shutdown.draining:
        raise KeyboardInterrupt


async def _wait_signal(stop: trio.Event) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            log.info("signal %s: returning leases and exiting", signal.Signals(sig).name)
            _Shutdown.draining = True
            stop.set()
            return


async def _cancel_when(stop: trio.Event, scope: trio.CancelScope) -> None:
    await stop.wait()
    scope.cancel()


async def _return_lease(host: Any, state: NodeState) -> None:
    from echorl.protocol.messages import LeaseReturn

    from echorl.protocol import routes
    from echorl.net.host import PeerUnavailable, RemoteError

    if not state.current_lease or not state.learner:
        return
    try:
        await host.request(state.learner, routes.RETURN,
                           LeaseReturn(run_id=state.run_id, lease_ids=[state.current_lease]), timeout=5)
        log.info("returned lease %s", state.current_lease)
    except (PeerUnavailable, RemoteError) as exc:
        log.warning("could not return lease %s: %s", state.current_lease, exc)


async def _work_forever(host: Any, cfg: NodeConfig, state: NodeState, cap: Any,
                        nursery: trio.Nursery) -> None:
    from echorl.protocol.errors import ErrorCode, ProtocolError

    from echorl.net.host import PeerUnavailable

    backoff = 0.5
    while True:
        started = time.monotonic()
        try:
            await _session(host, cfg, state, cap, nursery)
        except RunOver:
            return
        except ProtocolError as exc:  # an Error reply (RemoteError) or a RunEnded that fails verification
            if exc.code == ErrorCode.IDENTITY_IN_USE:
                raise NodeExit(2, f"the learner refused this node: {exc.detail} (key {cfg.key})") from None
            log.warning("learner refused (%s); retrying in %.1f s", exc, backoff)
        except (PeerUnavailable, trio.TooSlowError) as exc:
            log.warning("learner unreachable: %s; retrying in %.1f s", exc, backoff)
        if state.leases_done and time.monotonic() - started > 10.0:
            backoff = 0.5  # the session worked for a while: a fresh failure, not a streak
        state.current_lease = ""
        silent = time.monotonic() - state.last_contact
        if cfg.give_up_after > 0 and silent + backoff > cfg.give_up_after:
            raise NodeExit(1, f"gave up: no answer from the learner for {silent:.0f} s (--give-up-after "
                              f"{cfg.give_up_after:g}); is the run still going at {cfg.bootstrap}?")
        await trio.sleep(backoff * (0.75 + 0.5 * random.random()))
        backoff = min(backoff * 2, 15.0)


async def _session(host: Any, cfg: NodeConfig, state: NodeState, cap: Any, nursery: trio.Nursery) -> None:
    """Connect, join, get weights, then loop lease → generate → submit until an error ends the
    session."""
    import secrets

    from echorl.protocol import wire
    from echorl.protocol.messages import JoinAccepted, JoinRequest

    from echorl.protocol import routes
    from echorl.net.membership import find_learner

    weights = state.weights
    state.learner = await find_learner(host, cfg.bootstrap, state.run_id, state.membership,
                                       pinned=cfg.learner_id or None)
    await weights.attach(state.learner, nursery)
    join = wire.sign(JoinRequest(run_id=state.run_id, peer_id=host.peer_id, capability=cap, version=weights.version,
                                 timestamp=time.time(), nonce=secrets.token_bytes(16), instance=state.instance),
                     host.identity)
    accepted = await host.request(state.learner, routes.JOIN, join, expect=JoinAccepted)
    assert isinstance(accepted, JoinAccepted)
    state.last_contact = time.monotonic()
    _log_observed(host)
    log.info("joined run %s at learner version %d (S=%d) holding v%d", state.run_id, accepted.version,
             accepted.staleness_bound, weights.version)
    weights.joined(state.learner, accepted.incarnation)  # a restarted learner: drop its abandoned branch
    if weights.version > accepted.version:  # the learner resumed from an older checkpoint
        weights.forget(state.learner)
    if state.membership is not None:
        await state.membership.provide()
    await weights.ensure(0)
    idle = 0.05
    while True:
        lease, wait = await _request_lease(host, cfg, state)
        if lease is None:
            if wait > 0:
                await trio.sleep(max(wait, idle))
                idle = min(idle * 1.5, 0.5)
            continue
        idle = 0.05
        state.current_lease = lease.lease_id
        try:
            await _generate_and_submit(host, state, lease)
        except EnvironmentRefused as exc:  # cannot run this run's episodes: give the work back
            log.error("%s; returning the lease", exc)
            await _return_lease(host, state)
            state.current_lease = ""
            await trio.sleep(10.0)
            continue
        state.current_lease = ""
        state.leases_done += 1


async def _request_lease(host: Any, cfg: NodeConfig, state: NodeState) -> tuple[Any, float]:
    """(lease, 0) or (None, seconds to wait): a deferral for old or unknown weights updates them
    first and asks again at once (or shortly, if nothing newer is to be had yet)."""
    from echorl.protocol import wire
    from echorl.protocol.messages import Lease, LeaseDeferred, LeaseRequest, RunEnded

    from echorl.protocol import routes

    weights = state.weights
    reply = await host.request(state.learner, routes.LEASE,
                               LeaseRequest(run_id=state.run_id, version=weights.version,
                                            max_prompts=cfg.max_prompts, incarnation=weights.incarnation), expect=(Lease, LeaseDeferred, RunEnded))
    state.last_contact = time.monotonic()
    if isinstance(reply, RunEnded):
        await trio.to_thread.run_sync(wire.verify, reply, state.learner)  # only the pinned learner ends our run
        state.ended = reply
        raise RunOver()
    if isinstance(reply, Lease):
        return reply, 0.0
    assert isinstance(reply, LeaseDeferred)
    if reply.reason == "weights_unknown":  # ahead of the learner: it went back to a checkpoint
        weights.forget(state.learner)
        await weights.ensure(0)
        return None, 0.0
    if reply.reason == "weights_too_old":
        before = weights.version
        await weights.ensure(max(reply.want_version, weights.version + 1))
        return None, (0.05 if weights.version == before else 0.0)  # nothing newer anywhere yet
    return None, max(reply.retry_after_s, 0.01)


def _log_observed(host: Any) -> None:
    """Log how the learner sees us (identify's observed address), once it differs from before."""
    seen = host.observed_addrs()
    if seen and seen != getattr(host, "_logged_observed", None):
        host._logged_observed = seen
        mine = {a.split("/p2p/")[0].rsplit("/tcp/", 1)[0] for a in host.addrs}
        behind = all(a.rsplit("/tcp/", 1)[0] not in mine for a in seen)
        log.info("the learner sees this node as %s%s", ", ".join(seen),
                 " (not one of our addresses: behind NAT, so a broadcast leaf)" if behind else "")


class EnvironmentRefused(Exception):
    """A lease names an environment this node does not run (not built in, not ``--allow-env``)
    or cannot build with the given options."""


def _environment(state: NodeState, spec: Any) -> Any:
    """The episodic task of a lease's ``EpisodeSpec`` (built once per spec and options)."""
    from echorl.tasks import BUILTIN, TaskError, is_episodic, load_task

    key = repr((spec.env, sorted(spec.options.items())))
    if key not in state.envs:
        if spec.env not in BUILTIN and spec.env not in state.allow_env:
            raise EnvironmentRefused(f"environment {spec.env!r} is neither built in nor allowed (--allow-env)")
        try:
            task = load_task(spec.env, **{**spec.options, "max_turns": spec.max_turns})
        except TaskError as exc:
            raise EnvironmentRefused(f"environment {spec.env!r}: {exc}") from None
        if not is_episodic(task):
            raise EnvironmentRefused(f"{spec.env!r} is not an environment")
        state.envs[key] = task
    return state.envs[key]


async def _generate_and_submit(host: Any, state: NodeState, lease: Any) -> Any:
    import secrets

    from echorl.actor.types import SamplingParams
    from echorl.protocol import wire
    from echorl.protocol.messages import RolloutGroup, Sample, Submit, SubmitAccepted

    from echorl.net.host import RemoteError
    from echorl.protocol import routes

    sp = lease.sampling
    params = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, max_new_tokens=sp.max_new_tokens, stop=list(sp.stop))
    t0 = time.perf_counter()
    episode = lease.prompts[0].episode
    if episode is None:
        version, incarnation, groups = await state.weights.generate([p.text for p in lease.prompts], lease.group_size, params)
    else:
        from echorl.actor.episodes import run_episodes

        task = _environment(state, episode)
        seeds = [p.episode.seed if p.episode is not None else episode.seed for p in lease.prompts]
        version, incarnation, (_, groups) = await state.weights.run(run_episodes, state.weights.backend, task, seeds,
                                                       lease.group_size, params, episode.max_tokens)
    seconds = time.perf_counter() - t0
    wire_groups = [
        RolloutGroup(prompt_id=p.prompt_id, samples=[
            Sample(token_ids=list(s.token_ids), logprobs=[min(0.0, float(x)) for x in s.logprobs],
                   finish_reason=s.finish_reason if s.finish_reason in ("stop", "length", "eos") else "stop",
                   reward_hint=float(s.reward or 0.0), model_mask=s.mask) for s in g])
        for p, g in zip(lease.prompts, groups)
    ]
    submit = Submit(run_id=state.run_id, lease_id=lease.lease_id, peer_id=host.peer_id, behaviour_version=version,
                    groups=wire_groups, generate_seconds=seconds, nonce=secrets.token_bytes(16),
                    incarnation=incarnation)
    submit = await trio.to_thread.run_sync(wire.sign, submit, host.identity)
    state.groups_generated += len(wire_groups)
    state.tokens_generated += sum(len(s.token_ids) for g in wire_groups for s in g.samples)
    state.generate_seconds += seconds
    try:
        reply = await host.request(state.learner, routes.SUBMIT, submit, expect=SubmitAccepted, timeout=60)
    except RemoteError as exc:
        state.rejected[exc.code.value] = state.rejected.get(exc.code.value, 0) + 1
        state.publish()
        raise
    assert isinstance(reply, SubmitAccepted)
    await _keep_receipt(host, state, lease.lease_id, reply)
    state.publish()
    return reply


async def _keep_receipt(host: Any, state: NodeState, lease_id: str, reply: Any) -> None:
    """Verify the receipt against the pinned learner, this node, the run and the lease; append
    it to the receipts file (both in a worker thread: a signature check and an fsync)."""
    from echorl.node.receipts import check
    from echorl.protocol.errors import ProtocolError

    if reply.receipt is None:
        return
    try:
        await trio.to_thread.run_sync(check, reply.receipt, state.learner, host.peer_id, state.run_id, lease_id)
    except ProtocolError as exc:
        state.receipts_invalid += 1
        log.warning("receipt for lease %s refused: %s", lease_id, exc)
        return
    await trio.to_thread.run_sync(state.receipts.append, reply.receipt)
    state.receipts_kept += 1
    state.groups_credited += reply.receipt.groups
