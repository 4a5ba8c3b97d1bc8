"""``echorl node``: the volunteer node daemon: join with a signed capability record, receive
weights through the learner's broadcast (a relay that also forwards chunks to its plan children;
``node/versions.py``), then lease → generate (in a worker thread) → submit signed rollouts,
forever. A node refused for old weights waits for the broadcast in flight, then catches up from
peers, then fetches directly from the learner.

Addresses, the model directory, the device and the key file are checked before the model loads
(a bad one: one line, exit 2). This module is the entry (checks, start-up, signals, the exit
line); the conversation with the learner is ``node/session.py``, a lease's work
``node/rollouts.py``, the counters ``node/progress.py``. Reconnects with
exponential backoff (plus jitter, at most 15 s) when the learner is unreachable, saying why
(refused, timed out, wrong peer id); gives up with exit 1 after ``--give-up-after`` seconds
without the learner. A learner that refuses the key as already in use (``identity_in_use``) ends
the node at once (exit 2), as does a learner that serves another run (it is named, with the
``--run-id`` to use). When the run is over the learner answers ``RunEnded``: the node logs
its contribution and exits 0. On SIGTERM or SIGINT it returns the lease it holds (so its prompts
are re-queued at once), writes its newest version to disk and exits 0.

The newest verified version is kept in ``--state-dir`` (``node/state.py``); a restart with
the same key starts from it, after verifying it against the pinned learner and the run.

Each accepted submission comes back with the learner's signed receipt; the node verifies it and
appends it to ``--receipts`` (``node/receipts.py``). ``--metrics-port`` serves the node's counters
(``NodeState.row``, ``node/progress.py``) as Prometheus ``/metrics`` (docs/metrics.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import trio

from echorl.common import config, gc_pauses
from echorl.node.config import NodeConfig
from echorl.node.progress import NodeState
from echorl.node.rollouts import capability, load_backend
from echorl.node.session import NodeExit, return_lease, work_forever
from echorl.protocol.identity import Identity, load_or_create_identity, short_id

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p, NodeConfig)


def run(args: argparse.Namespace) -> int:
    cfg = config.configured(NodeConfig, args, "node")
    if isinstance(cfg, int):
        return cfg
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s node %(levelname)s %(message)s", stream=sys.stderr
    )
    try:
        device = _check(cfg)
        identity = load_or_create_identity(cfg.key)  # last: nothing is created for a refused command
    except ValueError as exc:  # ConfigError, AddressError, KeyFileError
        config.fail("node", exc)
        return 2
    log.info("node device: %s, engine %s", device, cfg.engine)
    signal.signal(signal.SIGTERM, _outside_trio_signal)  # trio's receiver restores this on exit
    try:
        trio.run(main, cfg, identity)
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
    from echorl.common.metrics_sinks import sink_flags_error

    cfg.check_model()
    cfg.key = os.path.expanduser(cfg.key)
    if problem := sink_flags_error(cfg.metrics_port):
        raise config.ConfigError(problem)
    if cfg.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise config.ConfigError("vllm is not installed: pip install 'echorl[vllm]' on a CUDA machine")
    from echorl.actor.device import pin_device

    device = pin_device(cfg)
    if cfg.engine == "vllm" and cfg.device != "cuda:0":
        raise config.ConfigError(
            f"--engine vllm runs on cuda:0 (choose the GPU with CUDA_VISIBLE_DEVICES), not {cfg.device}"
        )
    return device


def _check_addresses(cfg: NodeConfig) -> None:
    """Every address the user gave, checked before anything slow happens (AddressError)."""
    from echorl.net.addrs import parse_announce, parse_listen, parse_peer_addr

    cfg.bootstrap = parse_peer_addr(cfg.bootstrap)
    cfg.listen = parse_listen(cfg.listen)
    cfg.announce = [parse_announce(a) for a in cfg.announce]
    if cfg.learner_id:
        parse_peer_addr(f"/ip4/127.0.0.1/tcp/1/p2p/{cfg.learner_id}", "--learner-id")


async def main(cfg: NodeConfig, identity: Identity) -> None:
    from echorl.actor.model import default_model
    from echorl.common.metrics_sinks import open_sinks
    from echorl.net.host import HostConfig, open_host
    from echorl.net.membership import Membership
    from echorl.net.transport import UploadLimiter
    from echorl.node.adapters import NodeAdapters
    from echorl.node.receipts import ReceiptLog
    from echorl.node.state import SnapshotKeeper, default_state_dir, lock_state_dir
    from echorl.node.versions import NodeWeights

    state_dir = Path(cfg.state_dir).expanduser() if cfg.state_dir else default_state_dir(cfg.key, cfg.run_id)
    lock = lock_state_dir(state_dir)  # held until this process ends
    if lock is None:
        raise NodeExit(
            2,
            f"another node process with this key or state directory runs on this machine "
            f"({state_dir} is locked); give each node its own --key",
        )
    backend, tps = await trio.to_thread.run_sync(load_backend, cfg)
    log.info("node %s: %.0f tokens/s on %s (%s)", short_id(identity.peer_id), tps, cfg.device, cfg.dtype)
    import secrets

    state = NodeState(
        run_id=cfg.run_id,
        allow_env=tuple(cfg.allow_env),
        receipts=ReceiptLog(Path(cfg.receipts).expanduser() if cfg.receipts else state_dir / "receipts.jsonl"),
        instance=secrets.token_bytes(16),
        last_contact=time.monotonic(),
    )
    fatal: NodeExit | None = None  # raised once every nursery is closed (no exception group)
    try:
        state.sinks = open_sinks("node", cfg.metrics_port)
    except OSError as exc:
        raise SystemExit(f"echorl node: --metrics-port {cfg.metrics_port}: {exc}") from None
    log.info("receipts go to %s", state.receipts.path)
    async with open_host(identity, HostConfig(listen=cfg.listen, announce=tuple(cfg.announce))) as host:
        cap = capability(cfg, tps, host.addrs)
        state.weights = NodeWeights(
            host,
            cfg.run_id,
            backend,
            UploadLimiter.from_mbps(cfg.upload_mbps),
            keeper=SnapshotKeeper(state_dir, cfg.run_id),
            cache_bytes=int(cfg.chunk_cache_mb * 2**20),
            adapters=NodeAdapters(Path(cfg.model or default_model()).expanduser()),  # LoRA runs: over our base
        )
        gc_pauses.after_start_up()  # the model and host are loaded: out of full collections' reach
        async with trio.open_nursery() as nursery:
            state.membership = Membership(host, cfg.run_id, server=True)
            await nursery.start(state.membership.run)
            stop = trio.Event()
            nursery.start_soon(_wait_signal, stop)
            with trio.CancelScope() as work:
                nursery.start_soon(_cancel_when, stop, work)
                try:
                    await work_forever(host, cfg, state, cap, nursery)
                except NodeExit as exc:
                    fatal = exc
            _Shutdown.draining = True  # from here on the node is leaving, signal or not
            await return_lease(host, state)
            with trio.move_on_after(120):
                await state.weights.flush()  # the newest version on disk before we go
            nursery.cancel_scope.cancel()
    log.info(
        "node stopped after %d leases (%d tokens generated in %.1f s; versions loaded: %s; started from on-disk "
        "v%d); %d receipts for %d groups in %s",
        state.leases_done,
        state.tokens_generated,
        state.generate_seconds,
        state.weights.loads,
        state.weights.started_from,
        state.receipts_kept,
        state.groups_credited,
        state.receipts.path,
    )
    for sink in state.sinks:
        sink.close()
    if state.ended is not None:
        e = state.ended
        print(
            f"echorl node: run {e.run_id} is over (final version {e.version}, {e.steps} steps); this node "
            f"contributed {e.leases_done} leases, {e.groups_accepted} rollout groups accepted",
            file=sys.stderr,
        )
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
