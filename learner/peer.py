"""``echorl learner``: the learner peer: GRPO trainer fed by signed network rollouts.

It listens on libp2p, prints its bootstrap multiaddr (and writes it to ``--addr-file``), runs the
Kademlia server (first bootstrap peer, signed learner record), serves join/lease/submit/return/
status, and trains one step each time ``prompts_per_step`` fresh groups are buffered. Every κ-th
version (``publish_every``) goes out through the pipelined broadcast (``broadcast/broadcaster.py``:
deltas, a full snapshot every ``full_every`` publications) from a publication task that runs
beside training; the same bytes stay available to the direct fetch (``broadcast/weight_store.py``) as
the nodes' fallback. Each step's metrics go to ``--metrics-out`` (JSON lines), including the
newest completed broadcast and the provisioning rule of DESIGN §7:
required Σμ = κR / (κ·T_train − T_bcast) vs measured Σμ_i.

A ``--spot-check-fraction`` of submissions (default 0.1) has its behaviour log-probs recomputed
with the snapshot of the claimed version (``learner/spot_check.py``; the weight store keeps the last
S+1 published versions for it); a mismatch refuses the submission with ``logprob_mismatch`` and
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
import json
import logging
import signal
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger("echorl.node.learner")


@dataclass
class LearnerConfig:
    run_id: str = "echorl-demo"
    task: str = "addition"
    task_options: dict[str, Any] = field(default_factory=dict)  # the task's constructor options
    model: str = ""  # HF directory; "" builds/uses the default tiny model for ``seed``
    seed: int = 0
    steps: int = 0  # 0: train until stopped
    staleness: int = 4
    group_size: int = 8
    prompts_per_step: int = 16
    prompts_per_lease: int = 8
    lr: float = 5e-4
    clip: float = 0.2
    temperature: float = 1.0
    eval_every: int = 10
    eval_prompts: int = 1024
    lease_timeout_s: float = 30.0
    liveness_after_s: float = 3.0
    listen: str = "/ip4/127.0.0.1/tcp/0"
    key: str = ""
    addr_file: str = ""
    metrics_out: str = ""
    dht: bool = True
    publish_every: int = 0  # κ; 0: max(1, S−1) (DESIGN §7)
    full_every: int = 10  # a full snapshot every this many publications, deltas between
    fanout: int = 4
    chunk_kib: int = 256
    upload_mbps: float = 0.0  # this process's upload cap (broadcast + fallback fetch); 0: none
    broadcast_timeout_s: float = 120.0
    checkpoint_dir: str = ""
    checkpoint_every: int = 0  # steps; 0: only at the end and on SIGTERM
    resume: bool = False
    # DESIGN §3 spot checks (learner/spot_check.py): the fraction of submissions whose behaviour
    # log-probs are recomputed with the claimed version's snapshot (every one of a flagged peer);
    # a submission fails if mean |Δ| > tolerance_mean or max |Δ| > tolerance_max. The defaults
    # fit float32 CPU actors (they agree to ~1e-5); bf16/fp16 GPU actors need looser values.
    spot_check_fraction: float = 0.1
    spot_check_tolerance_mean: float = 0.02
    spot_check_tolerance_max: float = 0.5
    spot_check_ban_after: int = 3  # mismatches before a peer is refused leases (0: never)
    # DESIGN §7 cost-aware activation (learner/activation.py): "all" leases work to every node;
    # "cost" keeps the cheapest set (price per unit of measured throughput) that meets the
    # required throughput × (1 + margin + observed loss rate) active and parks the rest as standby
    activation: str = "all"
    activation_margin: float = 0.25

    @classmethod
    def load(cls, path: str | None, overrides: dict[str, Any]) -> "LearnerConfig":
        data: dict[str, Any] = json.loads(Path(path).read_text()) if path else {}
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown learner config keys: {sorted(unknown)}")
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="JSON file with LearnerConfig fields")
    p.add_argument("--listen", help="multiaddr to listen on (default /ip4/127.0.0.1/tcp/0)")
    p.add_argument("--key", help="key file (created if missing; default: a fresh key per run)")
    p.add_argument("--steps", type=int, help="stop after this many steps (0: run until stopped)")
    p.add_argument("--staleness", type=int, help="staleness bound S")
    p.add_argument("--metrics-out", dest="metrics_out", help="JSON-lines metrics file")
    p.add_argument("--addr-file", dest="addr_file", help="write the bootstrap multiaddr here")
    p.add_argument("--seed", type=int, help="seed of prompts and sampling (the built-in model is the same for every seed)")
    p.add_argument("--model", help="Hugging Face model directory (default: the tiny demo model)")
    p.add_argument("--task", help="built-in task name or module:Class (default: addition)")
    p.add_argument("--task-option", dest="task_option", action="append", metavar="KEY=VALUE",
                   help="task constructor option (repeatable; replaces the config file's task_options)")
    p.add_argument("--lease-timeout", dest="lease_timeout_s", type=float, help="seconds before an unanswered lease expires and its prompts are re-queued; "
                        "a slow node's leases get 4x its expected time (at most 20x this)")
    p.add_argument("--eval-every", dest="eval_every", type=int, help="held-out evaluation period in steps")
    p.add_argument("--no-dht", dest="dht", action="store_false", default=None, help="do not run the Kademlia DHT (nodes must bootstrap from the learner itself)")
    p.add_argument("--run-id", dest="run_id", help="identity of the run (kept across --resume)")
    p.add_argument("--publish-every", dest="publish_every", type=int, help="publication period κ (default max(1, S-1))")
    p.add_argument("--full-every", dest="full_every", type=int, help="full snapshot every K publications (default 10)")
    p.add_argument("--fanout", type=int, help="broadcast fanout / stripes (default 4)")
    p.add_argument("--upload-mbps", dest="upload_mbps", type=float, help="upload cap in Mbit/s (default: none)")
    p.add_argument("--checkpoint-dir", dest="checkpoint_dir", help="where to write checkpoints")
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int,
                   help="checkpoint period in steps (0: only at the end and on SIGTERM)")
    p.add_argument("--resume", action="store_true", default=None, help="continue from the newest checkpoint")
    p.add_argument("--spot-check-fraction", dest="spot_check_fraction", type=float,
                   help="fraction of submissions whose behaviour log-probs are recomputed with the claimed "
                        "version's snapshot; a mismatch refuses the submission and flags the peer, whose "
                        "submissions are then all checked (0: off; default 0.1)")
    p.add_argument("--activation", choices=("all", "cost"),
                   help="which nodes get leases: 'all' (default) every joined node; 'cost' only the cheapest set "
                        "(ascending price per unit of measured throughput) that meets the required throughput with "
                        "a margin (activation_margin, default 0.25, plus the observed node-loss rate); the rest are "
                        "parked as standby (deferred, still receiving broadcasts)")


def _check_task_and_model(cfg: LearnerConfig, task_option: list[str] | None) -> None:
    """Resolve the task options (``--task-option`` replaces the file's; the addition task's seed
    follows ``--seed``) and build the task once, so a bad task or model is a clear error now."""
    from echorl.tasks import load_task, parse_task_options

    if task_option:
        cfg.task_options = parse_task_options(task_option)
    if cfg.task == "addition":
        cfg.task_options.setdefault("seed", cfg.seed)
    load_task(cfg.task, **cfg.task_options)
    if cfg.model and not (Path(cfg.model) / "config.json").is_file():
        raise ValueError(f"--model {cfg.model} is not a Hugging Face model directory (no config.json)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner %(levelname)s %(message)s", stream=sys.stderr)
    keys = ("listen", "key", "steps", "staleness", "metrics_out", "addr_file", "seed", "model", "task",
            "lease_timeout_s", "eval_every", "dht", "run_id", "publish_every", "full_every", "fanout",
            "upload_mbps", "checkpoint_dir", "checkpoint_every", "resume", "spot_check_fraction", "activation")
    try:
        cfg = LearnerConfig.load(args.config, {k: getattr(args, k, None) for k in keys})
        _check_task_and_model(cfg, args.task_option)
    except (OSError, ValueError, TypeError) as exc:  # TaskError and JSON errors are ValueErrors
        print(f"echorl learner: {exc}", file=sys.stderr)
        return 2
    if cfg.activation not in ("all", "cost"):
        print(f"echorl learner: activation must be 'all' or 'cost', not {cfg.activation!r}", file=sys.stderr)
        return 2
    if cfg.resume and not cfg.checkpoint_dir:
        print("echorl learner: --resume needs --checkpoint-dir", file=sys.stderr)
        return 2
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
    from echorl.broadcast.weight_store import WeightStore

    identity = _identity(cfg)
    trainer = await trio.to_thread.run_sync(Trainer.build, cfg)
    if cfg.resume:
        await _resume(cfg, trainer)
    trainer.open_metrics()
    policy = LeasePolicy(staleness=cfg.staleness, group_size=cfg.group_size, prompts_per_step=cfg.prompts_per_step,
                         prompts_per_lease=cfg.prompts_per_lease, lease_timeout_s=cfg.lease_timeout_s,
                         liveness_after_s=cfg.liveness_after_s, sampling=trainer.sampling_spec(),
                         activation=cfg.activation, activation_margin=cfg.activation_margin)
    service = LearnerService(identity, cfg.run_id, trainer.task, trainer.tokenizer, trainer.buffer, policy,
                             trainer.vocab_size)
    service.version = service.published = trainer.grpo.version
    service.required_fn = trainer.required_rollouts_per_s
    limiter = UploadLimiter.from_mbps(cfg.upload_mbps)
    # the last S+1 published versions: every behaviour version still acceptable (t − b ≤ S) has
    # its snapshot at hand for spot checks (and for the nodes' fallback fetch)
    store = WeightStore(identity, cfg.run_id, keep=max(2, cfg.staleness + 1), upload_limit=limiter)
    if cfg.spot_check_fraction > 0:
        service.spot = await _spot_checker(cfg, trainer, store)
        service.ban_after = cfg.spot_check_ban_after
    remembered = restore_service(service, trainer.resume_extra.get("service", {}))
    trainer.service_state = lambda: service_state(service)
    try:
        async with open_host(identity, HostConfig(listen=cfg.listen)) as host:
            service.install(host)
            store.install(host)
            async with trio.open_nursery() as nursery:
                publisher = await _start_publishing(cfg, host, identity, trainer, service, store, limiter, nursery)
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
    finally:
        trainer.close()


async def _spot_checker(cfg: LearnerConfig, trainer: Any, store: Any) -> Any:
    """Spot checker over the snapshots held by the weight store and a scratch copy of the
    model, taken now (in a worker thread), before training starts: the checker never touches
    the trainer's model, and nothing is loaded from disk while another thread trains."""
    import copy

    from echorl.learner.spot_check import SpotChecker, store_snapshots

    scratch = await trio.to_thread.run_sync(lambda: copy.deepcopy(trainer.grpo.model))
    return SpotChecker(lambda: scratch, trainer.tokenizer, trainer.sampling_spec().temperature,
                       cfg.spot_check_fraction, store_snapshots(store), tolerance_mean=cfg.spot_check_tolerance_mean,
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


async def _start_publishing(cfg: LearnerConfig, host: Any, identity: Any, trainer: Any, service: Any, store: Any,
                            limiter: Any, nursery: trio.Nursery) -> Any:
    """Broadcaster + publication task; the current version (0, or the resumed one) is
    published as a full snapshot before any node can join."""
    from echorl.broadcast.broadcaster import Broadcaster
    from echorl.learner.publish import Publisher

    bc = Broadcaster(host, identity, cfg.run_id, fanout=cfg.fanout, chunk_bytes=cfg.chunk_kib * 1024,
                     full_every=cfg.full_every, upload_limit=limiter, announce_timeout_s=5.0,
                     done_timeout_s=cfg.broadcast_timeout_s)
    bc.install()
    await nursery.start(bc.run)
    publisher = Publisher(bc, store, service, timeout_s=cfg.broadcast_timeout_s, on_record=trainer.on_broadcast)
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


def config_dict(cfg: LearnerConfig) -> dict[str, Any]:
    return asdict(cfg)
