"""``echorl learner``: the learner peer: GRPO trainer fed by signed network rollouts.

It listens on libp2p, prints its bootstrap multiaddr (and writes it to ``--addr-file``), runs the
Kademlia server (first bootstrap peer, signed learner record), serves join/lease/submit/return/
status, and trains one step each time ``prompts_per_step`` fresh groups are buffered. Every κ-th
version (``publish_every``) goes out through the pipelined broadcast (``broadcast/broadcaster.py``:
deltas, a full snapshot every ``full_every`` publications) from a publication task that runs
beside training; the broadcaster's one chunk store also serves catch-up and the nodes' direct
fetch. Each step's metrics go to ``--metrics-out`` (JSON lines), including the
newest completed broadcast and the provisioning rule of architecture §7:
required Σμ = κR / (κ·T_train − T_bcast) vs measured Σμ_i.

A ``--spot-check-fraction`` of submissions (default 0.1) has its behaviour log-probs recomputed
with the snapshot of the claimed version (``learner/spot_check.py``; the broadcaster's store keeps
every version within S of the newest rebuildable for it); a mismatch refuses the submission with ``logprob_mismatch`` and
flags the peer, whose submissions are then all checked; after ``spot_check_ban_after`` (3)
mismatches it is refused leases.

With ``--checkpoint-dir`` the learner checkpoints atomically every ``--checkpoint-every`` steps,
at the end and on SIGTERM (model, optimizer, version, RNG, task cursor, every prompt not yet
trained); ``--resume`` continues from the newest checkpoint with the same run id, key
(``DIR/learner.key`` unless ``--key``) and version numbers; its first publication is a full
snapshot. Restart it on the same ``--listen`` address so running nodes find it again.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import trio

from echorl import config
from echorl.learner.config import LearnerConfig
from echorl.metrics_sinks import open_sinks, sink_flags_error

log = logging.getLogger("echorl.node.learner")


def add_arguments(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p, LearnerConfig)


def _check_task_and_model(cfg: LearnerConfig) -> None:
    """Build the task once (the addition task's seed follows ``--seed``) and check the model
    directory, so a bad task or model is a clear error now."""
    from echorl.tasks import load_task

    if cfg.task == "addition":
        cfg.task_options.setdefault("seed", cfg.seed)
    load_task(cfg.task, **cfg.task_options)
    cfg.check_model()


def run(args: argparse.Namespace) -> int:
    cfg = config.configured(LearnerConfig, args, "learner")
    if isinstance(cfg, int):
        return cfg
    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner %(levelname)s %(message)s", stream=sys.stderr)
    try:
        if cfg.resume and not cfg.checkpoint_dir:
            raise config.ConfigError("--resume needs --checkpoint-dir")
        if problem := sink_flags_error(cfg.metrics_port, cfg.tensorboard):
            raise config.ConfigError(problem)
        _check_task_and_model(cfg)  # TaskError is a ValueError
        device = cfg.pin_device()
        from echorl.learner.distributed import check_world

        check_world(cfg.device, cfg.nproc)
        _check_addresses(cfg)
    except ValueError as exc:  # AddressError is a ValueError too
        config.fail("learner", exc)
        return 2
    log.info("learner device: %s", device)
    cfg.checkpoint_dir = _default_checkpoint_dir(cfg)
    try:
        trio.run(serve, cfg)
    except KeyboardInterrupt:
        return 130
    return 0


def _check_addresses(cfg: LearnerConfig) -> None:
    """The listen and announce addresses, checked before training starts; a fixed port that
    another program (or learner) holds is refused here rather than failing inside libp2p."""
    from echorl.net.addrs import AddressError, parse_announce, parse_listen, port_taken

    cfg.listen = parse_listen(cfg.listen)
    cfg.announce = [parse_announce(a) for a in cfg.announce]
    taken = port_taken(cfg.listen)
    if taken:
        raise AddressError(taken)
def _default_checkpoint_dir(cfg: LearnerConfig) -> str:
    """``--checkpoint-dir`` as given (``none``: no checkpoints), else ``runs/<run id>-<time>/
    checkpoints``, named in the log at start: a crash never loses the whole run by default."""
    if cfg.checkpoint_dir.lower() == "none":
        return ""
    if cfg.checkpoint_dir:
        return cfg.checkpoint_dir
    path = Path("runs") / f"{cfg.run_id}-{time.strftime('%Y%m%d-%H%M%S')}" / "checkpoints"
    log.info("checkpoints go to %s (--checkpoint-dir to choose, 'none' for none)", path)
    return str(path)


async def serve(cfg: LearnerConfig, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Run the learner until ``cfg.steps`` are done or SIGTERM/SIGINT."""
    from echorl.learner.resume import redial
    from echorl.learner.service import LearnerService, LeasePolicy
    from echorl.learner.train import NetworkSource, Provisioning, build_loop, sampling_spec
    from echorl.net.host import HostConfig, open_host
    from echorl.net.transport import UploadLimiter

    identity = _identity(cfg)
    loop = await trio.to_thread.run_sync(build_loop, cfg)
    if cfg.resume:
        await _resume(cfg, loop)
    loop.open_metrics()
    try:
        loop.sinks = open_sinks("learner", cfg.metrics_port, cfg.tensorboard)
    except OSError as exc:
        raise SystemExit(f"echorl learner: --metrics-port {cfg.metrics_port}: {exc}") from None
    limiter = UploadLimiter.from_mbps(cfg.upload_mbps)
    provisioning = Provisioning(loop)
    try:
        async with open_host(identity, HostConfig(listen=cfg.listen, announce=tuple(cfg.announce))) as host:
            bc = _broadcaster(cfg, host, identity, limiter)
            log.info("learner incarnation %s (signed into every manifest)", bc.incarnation.hex())
            # every version a rollout may still claim (t − b ≤ S) is rebuildable from the broadcaster
            spot = await _spot_checker(cfg, loop, bc.version_bytes) if cfg.spot_check_fraction > 0 else None
            service = LearnerService(identity, cfg.run_id, loop.task, loop.eval_backend.tokenizer, loop.buffer,
                                     LeasePolicy.of(cfg, sampling_spec(loop)), int(loop.grpo.model.config.vocab_size),
                                     version=lambda: loop.version, published=loop.version,
                                     required=provisioning.required_rollouts_per_s, summary=lambda: loop.summary,
                                     spot=spot, ban_after=cfg.spot_check_ban_after, incarnation=bc.incarnation)
            service.ledger.price_per_hour = cfg.price_per_hour
            loop.attach("service", service)
            service.install(host)
            bc.server.admit = service.admits  # catch-up and chunk requests: joined peers only
            async with trio.open_nursery() as nursery:
                publisher = await _start_publishing(cfg, bc, loop, provisioning, service, nursery)
                loop.attach("publisher", publisher)
                await _announce(cfg, host, nursery, task_status)
                nursery.start_soon(service.maintain)
                nursery.start_soon(redial, host, service.remembered_addrs)  # nodes that knew our old address
                nursery.start_soon(_stop_on_signal, loop, service, nursery.cancel_scope)
                await loop.run(NetworkSource(service, publisher, provisioning))
                if not loop.stopping:  # the final version reaches the nodes, then they are told it is over
                    await publisher.drain(cfg.broadcast_timeout_s)
                    v = loop.version
                    await service.members.run_end.announce(v, v, lambda: [p.peer_id for p in service.active_peers(10.0)],
                                                   grace_s=min(30.0, cfg.lease_timeout_s))
                if cfg.checkpoint_dir:
                    await loop.checkpoint()
                log.info("done at v%d: eval_reward %s -> %s", loop.version, loop.first_eval, loop.last_eval)
                nursery.cancel_scope.cancel()
        print(run_summary(loop, service, cfg.staleness), flush=True)
    finally:
        loop.close()


async def _spot_checker(cfg: LearnerConfig, loop: Any, snapshots: Any) -> Any:
    """Spot checker over a scratch copy of the model, taken now (in a worker thread), before
    training starts: the checker never touches the trainer's model, and nothing is loaded from
    disk while another thread trains. ``snapshots``: the broadcaster's retained versions."""
    import copy

    from echorl.learner.spot_check import SpotChecker

    scratch = await trio.to_thread.run_sync(lambda: copy.deepcopy(loop.grpo.model))
    return SpotChecker(lambda: scratch, loop.eval_backend.tokenizer, loop.settings.temperature,
                       cfg.spot_check_fraction, snapshots, tolerance_mean=cfg.spot_check_tolerance_mean,
                       tolerance_max=cfg.spot_check_tolerance_max)


def _identity(cfg: LearnerConfig) -> Any:
    """The learner's key: ``--key``, else ``DIR/learner.key`` with a checkpoint dir (a resumed
    learner keeps its peer ID, which nodes pin), else a fresh one."""
    from echorl.protocol.identity import Identity, load_or_create_identity

    if cfg.key:
        return load_or_create_identity(cfg.key)
    if cfg.checkpoint_dir:
        Path(cfg.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        return load_or_create_identity(str(Path(cfg.checkpoint_dir) / "learner.key"))
    return Identity.generate()


async def _resume(cfg: LearnerConfig, loop: Any) -> None:
    """Load the newest checkpoint; its run id wins over the configured one (same run)."""
    if not await trio.to_thread.run_sync(loop.resume):
        log.info("no checkpoint in %s: starting a new run", cfg.checkpoint_dir)
        return
    run_id = loop.resumed_extra.get("run_id") or cfg.run_id
    if run_id != cfg.run_id:
        log.warning("run id %r from the checkpoint replaces %r", run_id, cfg.run_id)
        cfg.run_id = run_id
    log.info("resumed run %s at version %d (%d prompts pending)", cfg.run_id, loop.version,
             len(loop.buffer.pending_prompts()))


def _broadcaster(cfg: LearnerConfig, host: Any, identity: Any, limiter: Any) -> Any:
    """The broadcaster (it keeps the last S+1 published versions: the spot checks' snapshots)."""
    from echorl.broadcast.broadcaster import Broadcaster
    from echorl.net.ratelimit import RateLimit

    per_peer = cfg.fetch_mbps_per_peer * 1e6 / 8
    return Broadcaster(host, identity, cfg.run_id, fanout=cfg.fanout, chunk_bytes=cfg.chunk_kib * 1024 or None,
                       full_every=cfg.full_every, upload_limit=limiter, announce_timeout_s=5.0,
                       done_timeout_s=cfg.broadcast_timeout_s, retain=cfg.staleness,
                       cache_bytes=int(cfg.chunk_cache_mb * 2**20),
                       fetch_limit=RateLimit(per_peer, 64 * 2**20) if per_peer > 0 else None)


async def _start_publishing(cfg: LearnerConfig, bc: Any, loop: Any, provisioning: Any, service: Any,
                            nursery: trio.Nursery) -> Any:
    """Broadcaster + publication task; the current version (0, or the resumed one) is
    published as a full snapshot before any node can join."""
    from echorl.learner.publish import Publisher

    bc.install()
    await nursery.start(bc.run)
    publisher = Publisher(bc, service, timeout_s=cfg.broadcast_timeout_s, on_record=provisioning.on_broadcast)
    await publisher.publish(loop.version, await trio.to_thread.run_sync(loop.grpo.state_dict))
    await nursery.start(publisher.run)
    return publisher


async def _announce(cfg: LearnerConfig, host: Any, nursery: trio.Nursery, task_status: Any) -> Any:
    """DHT server + signed learner record; print and write the bootstrap address (the first
    advertised one: ``--announce``, else a real interface address, never a wildcard)."""
    from echorl.net.membership import Membership

    addrs = host.addrs
    addr = addrs[0]
    membership = Membership(host, cfg.run_id, server=True)
    membership.pin(host.peer_id)  # our DHT store keeps no one else's learner record
    if cfg.dht:
        await nursery.start(membership.run)
        await membership.publish_learner_record(addrs)
    print(f"learner bootstrap: {addr}", flush=True)
    for other in addrs[1:]:
        print(f"learner also at: {other}", flush=True)
    if cfg.addr_file:
        tmp = Path(cfg.addr_file + ".tmp")
        tmp.write_text(addr + "\n")
        tmp.replace(cfg.addr_file)
    task_status.started(addr)
    return membership if cfg.dht else None


async def _stop_on_signal(loop: Any, service: Any, scope: trio.CancelScope) -> None:
    """First SIGTERM/SIGINT: finish the current step, checkpoint (with a checkpoint dir), exit;
    a second one cancels at once."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            if loop.stopping:
                scope.cancel()
                return
            log.info("signal %s: stopping after the current step", signal.Signals(sig).name)
            loop.stop()
            service.stop()


def run_summary(loop: Any, service: Any, staleness: int) -> str:
    """The end-of-run paragraph (like the demo's): steps, eval, nodes, staleness, cost."""
    from echorl.protocol.identity import short_id

    row = {**(loop.last_row or {}),
           **service.ledger.metrics(service.peers.values(), loop.version, service.policy.group_size)}

    def r(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    nodes = ", ".join(f"{short_id(p)} {a.groups_accepted} groups/{a.rejected_total} rejected"
                      for p, a in sorted(service.ledger.accounts.items())) or "none"
    return (f"summary: {loop.version} steps in {r(row.get('elapsed_s'))} s; eval_reward {r(loop.first_eval)} -> "
            f"{r(loop.last_eval)}; staleness_max {r(row.get('staleness_max'))} (S={staleness}); "
            f"receipts {service.ledger.seq}; nodes: {nodes}; cost {r(row['cost_total'])} (learner "
            f"{r(row['cost_learner'])}, nodes {r(row['cost_nodes'])}), per step {r(row['cost_per_step'])}, per 1k "
            f"rollouts {r(row['cost_per_1k_rollouts'])}; same rollouts on the learner (estimate) "
            f"{r(row['cost_rollouts_on_learner_estimate'])}")
