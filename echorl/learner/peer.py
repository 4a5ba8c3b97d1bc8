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
every version within S of the newest rebuildable for it); a mismatch refuses the submission with
``logprob_mismatch`` and
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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import trio

from echorl.common import config, gc_pauses
from echorl.common.metrics_sinks import open_sinks, sink_flags_error
from echorl.learner import console
from echorl.learner.config import LearnerConfig
from echorl.rl.checkpoint import finished_run

if TYPE_CHECKING:
    from echorl.broadcast.broadcaster import Broadcaster
    from echorl.learner.ledger import Ledger
    from echorl.learner.publish import Publisher
    from echorl.learner.service import LearnerService
    from echorl.learner.spot_check import Snapshots, SpotChecker
    from echorl.learner.train import Provisioning
    from echorl.net.host import Host
    from echorl.net.membership import Membership
    from echorl.net.transport import UploadLimiter
    from echorl.protocol.identity import Identity
    from echorl.protocol.messages import AdapterSpec
    from echorl.rl.loop import TrainingLoop

log = logging.getLogger(__name__)


class TaskStarted(Protocol):
    """What ``nursery.start`` hands a task (trio's ``TaskStatus``): it reports the address."""

    def started(self, value: str) -> None: ...


def add_arguments(p: argparse.ArgumentParser) -> None:
    config.add_arguments(p, LearnerConfig)


def _check_task_and_model(cfg: LearnerConfig) -> None:
    """Build the task once (the addition task's seed follows ``--seed``) and check the model
    directory, so a bad task or model is a clear error now."""
    from echorl.tasks import load_task

    if cfg.task == "addition":
        cfg.task_options.setdefault("seed", cfg.seed)
    cfg.check_task(load_task(cfg.task, **cfg.task_options))
    cfg.check_model()


def run(args: argparse.Namespace) -> int:
    cfg = config.configured(LearnerConfig, args, "learner")
    if isinstance(cfg, int):
        return cfg
    logging.basicConfig(
        level=cfg.log_level.upper(), format="%(asctime)s learner %(levelname)s %(message)s", stream=sys.stderr
    )
    try:
        if cfg.resume and not cfg.checkpoint_dir:
            raise config.ConfigError("--resume needs --checkpoint-dir")
        if cfg.resume and (done := finished_run(cfg.checkpoint_dir, cfg.steps)):
            print(f"echorl learner: {done}", file=sys.stderr)
            return 0
        if problem := sink_flags_error(cfg.metrics_port, cfg.tensorboard):
            raise config.ConfigError(problem)
        _check_task_and_model(cfg)  # TaskError is a ValueError
        from echorl.actor.device import pin_device

        device = pin_device(cfg)
        from echorl.rl.distributed import check_world

        check_world(cfg.device, cfg.nproc)
        _check_addresses(cfg)
        cfg.checkpoint_dir = _default_checkpoint_dir(cfg)
        _identity(cfg)  # a key file problem (KeyFileError) is one line now, not a traceback in serve
    except (ValueError, OSError) as exc:  # AddressError and KeyFileError are ValueErrors too
        config.fail("learner", exc)
        return 2
    log.info("learner device: %s", device)
    from echorl.rl.distributed import DistributedError

    try:
        failed = trio.run(serve, cfg)
    except KeyboardInterrupt:
        return 130
    except DistributedError as exc:  # the data-parallel ranks could not start (or resume)
        log.error("%s", exc)
        return 1
    return 1 if failed else 0


def _check_addresses(cfg: LearnerConfig) -> None:
    """The listen and announce addresses, checked before training starts; a fixed port that
    another program (or learner) holds is refused here rather than failing inside libp2p."""
    from echorl.net.addrs import checked_listen

    cfg.listen, cfg.announce = checked_listen(cfg.listen, cfg.announce)


def _default_checkpoint_dir(cfg: LearnerConfig) -> str:
    """``--checkpoint-dir`` as given (``none``: no checkpoints), else ``runs/<run id>-<time>/
    checkpoints``, named in the log at start: a crash never loses the whole run by default."""
    from echorl.rl.build import checkpoint_dir

    path = checkpoint_dir(cfg.checkpoint_dir, cfg.run_id)
    if path and not cfg.checkpoint_dir:
        log.info("checkpoints go to %s (--checkpoint-dir to choose, 'none' for none)", path)
    return path


async def serve(cfg: LearnerConfig, task_status: TaskStarted = trio.TASK_STATUS_IGNORED) -> str | None:
    """Run the learner until ``cfg.steps`` are done or SIGTERM/SIGINT; returns why training had
    to stop early (a data-parallel worker lost; the run is checkpointed), else None."""
    from echorl.actor.lora import run_adapter
    from echorl.learner.peers import PeerBook
    from echorl.learner.resume import redial
    from echorl.learner.service import LearnerService
    from echorl.learner.train import NetworkSource, Provisioning, sampling_spec
    from echorl.net.host import HostConfig, open_host
    from echorl.net.transport import UploadLimiter
    from echorl.rl.build import build_loop
    from echorl.tasks import load_task

    identity = _identity(cfg)
    loop = await trio.to_thread.run_sync(  # loads weights and the task: off the event loop
        lambda: build_loop(cfg, load_task(cfg.task, **cfg.task_options), meta={"run_id": cfg.run_id})
    )
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
            adapter = await trio.to_thread.run_sync(run_adapter, loop.grpo.model)  # LoRA: the base's name
            book = PeerBook()  # the members: the service keeps them, the broadcaster serves only them
            # catch-up and chunk requests: joined peers and doctor probes only (the service, made below, says)
            bc = _broadcaster(cfg, host, identity, limiter, lambda pid: service.reads_weights(pid), adapter)
            log.info("learner incarnation %s (signed into every manifest)", bc.incarnation.hex())
            # every version a rollout may still claim (t − b ≤ S) is rebuildable from the broadcaster
            spot = await _spot_checker(cfg, loop, bc.version_bytes) if cfg.spot_check_fraction > 0 else None
            service = LearnerService(
                identity,
                cfg.run_id,
                loop.task,
                loop.eval_backend.tokenizer,
                loop.buffer,
                cfg,
                int(loop.eval_backend.model.config.vocab_size),
                sampling=sampling_spec(loop),
                version=lambda: loop.version,
                published=loop.version,
                required=provisioning.required_rollouts_per_s,
                summary=lambda: {**loop.summary, **loop.faults},
                learner_rate=lambda: loop.gen_samples_per_s,
                spot=spot,
                incarnation=bc.incarnation,
                peers=book,
            )
            loop.attach("service", service)
            service.install(host)
            gc_pauses.after_start_up()  # the model, task and host are loaded: out of full collections' reach
            async with trio.open_nursery() as nursery:
                publisher = await _start_publishing(cfg, bc, loop, provisioning, service, nursery)
                loop.attach("publisher", publisher)
                await _announce(cfg, host, nursery, task_status)
                nursery.start_soon(console.watch, lambda: _progress(cfg, loop, service), host.addrs[0], cfg.run_id)
                nursery.start_soon(service.maintain)
                nursery.start_soon(redial, host, book.remembered_addrs)  # nodes that knew our old address
                nursery.start_soon(_stop_on_signal, loop, service, nursery.cancel_scope)
                await loop.run(NetworkSource(service, publisher, provisioning))
                if not loop.stopping:  # the final version reaches the nodes, then they are told it is over
                    await publisher.drain(cfg.broadcast_timeout_s)
                    await service.end_run(loop.version, grace_s=min(30.0, cfg.lease_timeout_s))
                nursery.cancel_scope.cancel()
        # the host is closed: no receipt is issued any more, so the checkpoint holds every node's
        # credit as its receipts say (a resumed learner's per-node figures go on from there)
        if cfg.checkpoint_dir:
            await loop.checkpoint()
        log.info("done at v%d: eval_reward %s -> %s", loop.version, loop.first_eval, loop.last_eval)
        print(run_summary(loop, service.ledger, cfg.staleness, cfg.group_size), flush=True)
    finally:
        loop.close()
    return loop.failed


def _progress(cfg: LearnerConfig, loop: TrainingLoop, service: LearnerService) -> console.Progress:
    """The console's figures now (learner/console.py)."""
    row = loop.last_row or {}
    return console.Progress(
        step=loop.version,
        steps_target=cfg.steps,
        eval_reward=loop.last_eval,
        nodes=len(service.active_peers()),
        staleness_max=row.get("staleness_max"),
        staleness_bound=cfg.staleness,
        groups_per_s=row.get("rollouts_per_s"),
    )


async def _spot_checker(cfg: LearnerConfig, loop: TrainingLoop, snapshots: Snapshots) -> SpotChecker:
    """Spot checker over a scratch copy of the model, taken now (in a worker thread), before
    training starts: the checker never touches the trainer's model, and nothing is loaded from
    disk while another thread trains. ``snapshots``: the broadcaster's retained versions."""
    import copy

    from echorl.learner.spot_check import SpotChecker

    scratch = await trio.to_thread.run_sync(lambda: copy.deepcopy(loop.grpo.model))
    return SpotChecker(
        lambda: scratch,
        loop.eval_backend.tokenizer,
        loop.settings.temperature,
        cfg.spot_check_fraction,
        snapshots,
        tolerance_mean=cfg.spot_check_tolerance_mean,
        tolerance_max=cfg.spot_check_tolerance_max,
    )


def _identity(cfg: LearnerConfig) -> Identity:
    """The learner's key: ``--key``, else ``DIR/learner.key`` with a checkpoint dir (a resumed
    learner keeps its peer ID, which nodes pin), else a fresh one."""
    from echorl.protocol.identity import Identity, load_or_create_identity

    if cfg.key:
        return load_or_create_identity(cfg.key)
    if cfg.checkpoint_dir:
        Path(cfg.checkpoint_dir).mkdir(parents=True, exist_ok=True)
        return load_or_create_identity(str(Path(cfg.checkpoint_dir) / "learner.key"))
    return Identity.generate()


async def _resume(cfg: LearnerConfig, loop: TrainingLoop) -> None:
    """Load the newest checkpoint; its run id wins over the configured one (same run)."""
    if not await trio.to_thread.run_sync(loop.resume):
        log.info("no checkpoint in %s: starting a new run", cfg.checkpoint_dir)
        return
    run_id = (loop.resumed_extra or {}).get("run_id") or cfg.run_id
    if run_id != cfg.run_id:
        log.warning("run id %r from the checkpoint replaces %r", run_id, cfg.run_id)
        cfg.run_id = run_id
    log.info(
        "resumed run %s at version %d (%d prompts pending)",
        cfg.run_id,
        loop.version,
        len(loop.buffer.pending_prompts()),
    )


def _broadcaster(
    cfg: LearnerConfig,
    host: Host,
    identity: Identity,
    limiter: UploadLimiter,
    admit: Callable[[str], bool],
    adapter: AdapterSpec | None = None,
) -> Broadcaster:
    """The broadcaster (it keeps the last S+1 published versions: the spot checks' snapshots);
    catch-up and chunk requests are served to the peers ``admit`` names (the joined ones);
    ``adapter``: LoRA runs name the base model in every manifest."""
    from echorl.broadcast.broadcaster import Broadcaster
    from echorl.net.ratelimit import RateLimit

    per_peer = cfg.fetch_mbps_per_peer * 1e6 / 8
    return Broadcaster(
        host,
        identity,
        cfg.run_id,
        fanout=cfg.fanout,
        chunk_bytes=cfg.chunk_kib * 1024 or None,
        full_every=cfg.full_every,
        upload_limit=limiter,
        announce_timeout_s=5.0,
        done_timeout_s=cfg.broadcast_timeout_s,
        retain=cfg.staleness,
        cache_bytes=int(cfg.chunk_cache_mb * 2**20),
        fetch_limit=RateLimit(per_peer, 64 * 2**20) if per_peer > 0 else None,
        weigh=cfg.plan_weights,
        admit=admit,
        adapter=adapter,
    )


async def _start_publishing(
    cfg: LearnerConfig,
    bc: Broadcaster,
    loop: TrainingLoop,
    provisioning: Provisioning,
    service: LearnerService,
    nursery: trio.Nursery,
) -> Publisher:
    """Broadcaster + publication task; the current version (0, or the resumed one) is
    published as a full snapshot before any node can join."""
    from echorl.learner.publish import Publisher

    bc.install()
    await nursery.start(bc.run)
    publisher = Publisher(bc, service, timeout_s=cfg.broadcast_timeout_s, on_record=provisioning.on_broadcast)
    await publisher.publish(loop.version, await trio.to_thread.run_sync(loop.grpo.published_state))
    nursery.start_soon(publisher.run)
    return publisher


async def _announce(
    cfg: LearnerConfig, host: Host, nursery: trio.Nursery, task_status: TaskStarted
) -> Membership | None:
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


async def _stop_on_signal(loop: TrainingLoop, service: LearnerService, scope: trio.CancelScope) -> None:
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


def run_summary(loop: TrainingLoop, ledger: Ledger, staleness: int, group_size: int) -> str:
    """The end-of-run paragraph (like the demo's): steps, eval, nodes, staleness, cost."""
    row = {**(loop.last_row or {}), **ledger.metrics(loop.version, group_size)}

    def r(v: object) -> str:
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    return (
        f"summary: {loop.version} steps in {r(row.get('elapsed_s'))} s; eval_reward {r(loop.first_eval)} -> "
        f"{r(loop.last_eval)}; staleness_max {r(row.get('staleness_max'))} (S={staleness}); "
        f"receipts {ledger.seq}; nodes: {ledger.nodes_line()}; cost {r(row['cost_total'])} (learner "
        f"{r(row['cost_learner'])}, nodes {r(row['cost_nodes'])}), per step {r(row['cost_per_step'])}, per 1k "
        f"rollouts {r(row['cost_per_1k_rollouts'])}; same rollouts on the learner (estimate) "
        f"{r(row['cost_rollouts_on_learner_estimate'])}"
    )
