"""``echorl learner``: the learner peer: GRPO trainer fed by signed network rollouts.

It listens on libp2p, prints its bootstrap multiaddr (and writes it to ``--addr-file``), runs the
Kademlia server (first bootstrap peer, signed learner record), serves join/lease/submit/return/
status and the weights (manifest + chunks), and trains one step each time ``prompts_per_step``
fresh groups are buffered. Each step's metrics go to ``--metrics-out`` (JSON lines), including
the provisioning rule of DESIGN §7: required Σμ = κR / (κ·T_train − T_bcast) vs measured Σμ_i.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import trio

log = logging.getLogger("echorl.node.learner")


@dataclass
class LearnerConfig:
    run_id: str = "echorl-demo"
    task: str = "addition"
    task_options: dict[str, Any] = field(default_factory=lambda: {"digits": 2, "seed": 0})
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

    @classmethod
    def load(cls, path: str | None, overrides: dict[str, Any]) -> "LearnerConfig":
        data: dict[str, Any] = json.loads(Path(path).read_text()) if path else {}
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise SystemExit(f"unknown learner config keys: {sorted(unknown)}")
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
    p.add_argument("--seed", type=int)
    p.add_argument("--model", help="Hugging Face model directory (default: the tiny demo model)")
    p.add_argument("--lease-timeout", dest="lease_timeout_s", type=float)
    p.add_argument("--eval-every", dest="eval_every", type=int)
    p.add_argument("--no-dht", dest="dht", action="store_false", default=None)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s learner %(levelname)s %(message)s", stream=sys.stderr)
    keys = ("listen", "key", "steps", "staleness", "metrics_out", "addr_file", "seed", "model",
            "lease_timeout_s", "eval_every", "dht")
    cfg = LearnerConfig.load(args.config, {k: getattr(args, k, None) for k in keys})
    try:
        trio.run(serve, cfg)
    except KeyboardInterrupt:
        return 130
    return 0


async def serve(cfg: LearnerConfig, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Run the learner until ``cfg.steps`` are done or SIGTERM/SIGINT."""
    from .learner_train import Trainer
    from .host import HostConfig, open_host
    from .learner_service import LearnerService, LeasePolicy
    from .membership import Membership
    from .weights import WeightStore
    from echorl.protocol.identity import Identity, load_or_create_identity

    identity = load_or_create_identity(cfg.key) if cfg.key else Identity.generate()
    trainer = await trio.to_thread.run_sync(Trainer.build, cfg)
    policy = LeasePolicy(staleness=cfg.staleness, group_size=cfg.group_size, prompts_per_step=cfg.prompts_per_step,
                         prompts_per_lease=cfg.prompts_per_lease, lease_timeout_s=cfg.lease_timeout_s,
                         liveness_after_s=cfg.liveness_after_s, sampling=trainer.sampling_spec())
    service = LearnerService(identity, cfg.run_id, trainer.task, trainer.tokenizer, trainer.buffer, policy,
                             trainer.vocab_size)
    store = WeightStore(identity, cfg.run_id, keep=cfg.staleness + 2)
    async with open_host(identity, HostConfig(listen=cfg.listen)) as host:
        service.install(host)
        store.install(host)
        await store.publish(0, await trio.to_thread.run_sync(trainer.grpo.state_dict))
        addr = host.addrs[0]
        async with trio.open_nursery() as nursery:
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
            nursery.start_soon(service.maintain)
            nursery.start_soon(_stop_on_signal, nursery.cancel_scope)
            await trainer.loop(service, store, membership if cfg.dht else None)
            nursery.cancel_scope.cancel()
    trainer.close()


async def _stop_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for sig in signals:
            log.info("signal %s: stopping", signal.Signals(sig).name)
            scope.cancel()
            return


def config_dict(cfg: LearnerConfig) -> dict[str, Any]:
    return asdict(cfg)
