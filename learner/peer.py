"""``echorl learner``: the learner peer: GRPO trainer fed by signed network rollouts.

It listens on libp2p, prints its bootstrap multiaddr (and writes it to ``--addr-file``), runs the
Kademlia server (first bootstrap peer, signed learner record), serves join/lease/submit/return/
status, and trains one step each time ``prompts_per_step`` fresh groups are buffered. Every κ-th
version (``publish_every``) goes out through the pipelined broadcast (``broadcast/broadcaster.py``:
deltas, a full snapshot every ``full_every`` publications) from a publication task that runs
beside training; the broadcaster's one chunk store also serves catch-up and the nodes' direct
fetch. Each step's metrics go to ``--metrics-out`` (JSON lines), including the
newest completed broadcast and the provisioning rule of DESIGN §7:
required Σμ = κR / (κ·T_train − T_bcast) vs measured Σμ_i. The same row feeds ``/metrics``
(``--metrics-port``, Prometheus) and TensorBoard (``--tensorboard DIR``): ``echorl/metrics_sinks.py``.
Every accepted submission is answered with a signed receipt (``learner/ledger.py``, which also
keeps per-node rejections by reason and the run's cost, learner ``--price-per-hour`` included).
At the end the learner prints a one-paragraph summary (steps, eval, nodes, cost).

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
        _check_task_and_model(cfg)  # TaskError is a ValueError
        if problem := sink_flags_error(cfg.metrics_port, cfg.tensorboard):
            raise config.ConfigError(problem)
        device = cfg.pin_device()
    except ValueError as exc:
        config.fail("learner", exc)
        return 2
    log.info("learner device: %s", device)
    try:
        trio.run(serve, cfg)
    except KeyboardInterrupt:
        return 130
    return 0


async def serve(cfg: LearnerConfig, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Run the learner until ``cfg.steps`` are done or SIGTERM/SIGINT."""
    from echorl.learner.train import Trainer
    from echorl.net.host import HostConfig, open_host
    from echorl.learner.resume import redial, restore_service, service_state
    from echorl.learner.service import LearnerService, LeasePolicy
    from echorl.net.transport import UploadLimiter

    identity = _identity(cfg)
    trainer = await trio.to_thread.run_sync(Trainer.build, cfg)
    if cfg.resume:
        await _resume(cfg, trainer)
    trainer.open_metrics()
    try:
        trainer.sinks = open_sinks("learner", cfg.metrics_port, cfg.tensorboard)
    except OSError as exc:
        raise SystemExit(f"echorl learner: --metrics-port {cfg.metrics_port}: {exc}") from None
    policy = LeasePolicy.of(cfg, trainer.sampling_spec())
    service = LearnerService(identity, cfg.run_id, trainer.task, trainer.tokenizer, trainer.buffer, policy,
                             trainer.vocab_size)
    service.version = service.published = trainer.grpo.version
    service.required_fn = trainer.required_rollouts_per_s
    service.ledger.price_per_hour = cfg.price_per_hour
    limiter = UploadLimiter.from_mbps(cfg.upload_mbps)
    if cfg.spot_check_fraction > 0:
        service.spot = await _spot_checker(cfg, trainer)
        service.ban_after = cfg.spot_check_ban_after
    remembered = restore_service(service, trainer.resume_extra.get("service", {}))
    trainer.service_state = lambda: service_state(service)
    try:
        async with open_host(identity, HostConfig(listen=cfg.listen)) as host:
            service.install(host)
            async with trio.open_nursery() as nursery:
                publisher = await _start_publishing(cfg, host, identity, trainer, service, limiter, nursery)
                membership = await _announce(cfg, host, nursery, task_status)
                nursery.start_soon(service.maintain)
                nursery.start_soon(redial, host, remembered)  # nodes that knew our old address
                nursery.start_soon(_stop_on_signal, trainer, service, nursery.cancel_scope)
                await trainer.loop(service, publisher, membership)
                if not trainer.stopping:  # the final version reaches the nodes
                    await publisher.drain(cfg.broadcast_timeout_s)
                if cfg.checkpoint_dir:
                    await trainer.checkpoint()
                nursery.cancel_scope.cancel()
        print(run_summary(trainer, service), flush=True)
    finally:
        trainer.close()


async def _spot_checker(cfg: LearnerConfig, trainer: Any) -> Any:
    """Spot checker over a scratch copy of the model, taken now (in a worker thread), before
    training starts: the checker never touches the trainer's model, and nothing is loaded from
    disk while another thread trains. Its snapshots come from the broadcaster's store, bound
    in ``_start_publishing`` before the first version is published."""
    import copy

    from echorl.learner.spot_check import SpotChecker

    scratch = await trio.to_thread.run_sync(lambda: copy.deepcopy(trainer.grpo.model))
    return SpotChecker(lambda: scratch, trainer.tokenizer, trainer.sampling_spec().temperature,
                       cfg.spot_check_fraction, lambda version: None, tolerance_mean=cfg.spot_check_tolerance_mean,
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


async def _resume(cfg: LearnerConfig, trainer: Any) -> None:
    if not await trio.to_thread.run_sync(trainer.resume):
        log.info("no checkpoint in %s: starting a new run", cfg.checkpoint_dir)
        return
    run_id = trainer.resume_extra.get("run_id") or cfg.run_id
    if run_id != cfg.run_id:
        log.warning("run id %r from the checkpoint replaces %r", run_id, cfg.run_id)
        cfg.run_id = run_id
    log.info("resumed run %s at version %d (%d prompts pending)", cfg.run_id, trainer.grpo.version,
             len(trainer.buffer.pending_prompts()))


async def _start_publishing(cfg: LearnerConfig, host: Any, identity: Any, trainer: Any, service: Any,
                            limiter: Any, nursery: trio.Nursery) -> Any:
    """Broadcaster + publication task; the current version (0, or the resumed one) is
    published as a full snapshot before any node can join."""
    from echorl.broadcast.broadcaster import Broadcaster
    from echorl.learner.publish import Publisher

    bc = Broadcaster(host, identity, cfg.run_id, fanout=cfg.fanout, chunk_bytes=cfg.chunk_kib * 1024,
                     full_every=cfg.full_every, upload_limit=limiter, announce_timeout_s=5.0,
                     done_timeout_s=cfg.broadcast_timeout_s, retain=cfg.staleness,
                     cache_bytes=int(cfg.chunk_cache_mb * 2**20))
    if service.spot is not None:  # every version a rollout may still claim (t − b ≤ S) is rebuildable
        service.spot.snapshots = bc.version_bytes
    bc.install()
    await nursery.start(bc.run)
    publisher = Publisher(bc, service, timeout_s=cfg.broadcast_timeout_s, on_record=trainer.on_broadcast)
    await publisher.publish(trainer.grpo.version, await trio.to_thread.run_sync(trainer.grpo.state_dict))
    await nursery.start(publisher.run)
    return publisher


async def _announce(cfg: LearnerConfig, host: Any, nursery: trio.Nursery, task_status: Any) -> Any:
    """DHT server + signed learner record; print and write the bootstrap address."""
    from echorl.net.membership import Membership

    addr = host.addrs[0]
    membership = Membership(host, cfg.run_id, server=True)
    if cfg.dht:
        await nursery.start(membership.run)
        await membership.publish_learner_record(addr)
    print(f"learner bootstrap: {addr}", flush=True)
    if cfg.addr_file:
        tmp = Path(cfg.addr_file + ".tmp")
        tmp.write_text(addr + "\n")
        tmp.replace(cfg.addr_file)
    task_status.started(addr)
    return membership if cfg.dht else None


async def _stop_on_signal(trainer: Any, service: Any, scope: trio.CancelScope) -> None:
    """First SIGTERM/SIGINT: finish the current step, checkpoint (with a checkpoint dir), exit;
    a second one cancels at once."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            if trainer.stopping:
                scope.cancel()
                return
            log.info("signal %s: stopping after the current step", signal.Signals(sig).name)
            trainer.stopping = True
            service.stopping = True
            service.accepted.set()


def run_summary(trainer: Any, service: Any) -> str:
    """The end-of-run paragraph (like the demo's): steps, eval, nodes, staleness, cost."""
    from echorl.protocol.identity import short_id

    row = {**trainer.last_row, **service.ledger.metrics(service.peers.values(), trainer.step, service.policy.group_size)}

    def r(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    nodes = ", ".join(f"{short_id(p)} {a.groups_accepted} groups/{a.rejected_total} rejected"
                      for p, a in sorted(service.ledger.accounts.items())) or "none"
    return (f"summary: {trainer.step} steps in {r(row.get('elapsed_s'))} s; eval_reward {r(trainer.first_eval)} -> "
            f"{r(trainer.last_eval)}; staleness_max {r(row.get('staleness_max'))} (S={trainer.cfg.staleness}); "
            f"receipts {service.ledger.seq}; nodes: {nodes}; cost {r(row['cost_total'])} (learner "
            f"{r(row['cost_learner'])}, nodes {r(row['cost_nodes'])}), per step {r(row['cost_per_step'])}, per 1k "
            f"rollouts {r(row['cost_per_1k_rollouts'])}; same rollouts on the learner (estimate) "
            f"{r(row['cost_rollouts_on_learner_estimate'])}")
