"""``echorl serve``: a Tinker-API endpoint that trains LoRA adapters on a base model it holds.

Startup: read the API key file (refused in one line, exit 2, if missing or malformed), load the
base model (``--model``, default the shipped tiny model), then run on one trio loop: the HTTP
endpoint (:mod:`echorl.net.http_server`), the compute worker, the session reaper, with
``--metrics-port`` the usage export (:mod:`echorl.service.accounting`) and with ``--swarm`` the
learner peer nodes join (:mod:`echorl.service.swarm`). Prints one line with the URL and the model
name that clients pass as ``base_model`` (and the ``/metrics`` URL, the swarm's bootstrap address
and run id).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import trio

from echorl.common import config as cfgmod
from echorl.common import gc_pauses

from .config import ServeConfig

log = logging.getLogger(__name__)
REAP_EVERY_S = 30.0
"""How often idle sessions are looked for (their TTL is minutes)."""


class MetricsPortError(OSError):
    """``--metrics-port`` cannot be listened on: one line, exit 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cfgmod.add_arguments(parser, ServeConfig)


def build(cfg: ServeConfig):  # -> tuple[App, Api]; late imports: torch and the web stack load here only
    from echorl.actor.device import pin_device
    from echorl.actor.model import default_model

    from .api import Api
    from .engine import Engine
    from .http import App
    from .sessions import load_keys

    keys = load_keys(cfg.api_keys)
    pin_device(cfg)
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    model_dir = Path(cfg.model) if cfg.model else default_model()
    engine = Engine(model_dir, device=cfg.device, dtype=cfg.dtype)
    name = cfg.model_name or ("echorl-tiny" if not cfg.model else model_dir.resolve().name)
    swarm = None
    if cfg.swarm:
        from echorl.protocol.identity import Identity

        from .swarm import Swarm

        swarm = Swarm(cfg, engine, Identity.generate())
    api = Api(cfg, engine, name, swarm)
    return App(api, keys), api


async def _reap(api) -> None:
    while True:
        await trio.sleep(REAP_EVERY_S)
        if n := api.expire():
            log.info("closed %d idle session(s)", n)


async def serve(cfg: ServeConfig, app, api, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The endpoint, the worker, the reaper and the usage export until cancelled; ``task_status``
    gets the URL (and `` metrics=<URL>`` with ``--metrics-port``)."""
    from echorl.common.metrics_sinks import open_sinks
    from echorl.net.http_server import serve_asgi

    from . import accounting

    try:
        sinks = open_sinks("serve", cfg.metrics_port)
    except OSError as exc:
        raise MetricsPortError(f"cannot serve /metrics on {cfg.metrics_port}: {exc.strerror or exc}") from None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(api.worker.run)
            nursery.start_soon(_reap, api)
            if sinks:
                nursery.start_soon(accounting.export, api.sessions, sinks)
            urls = await nursery.start(serve_asgi, app.app, cfg.host, cfg.port)
            where = "".join(f" metrics=http://{s.server.server_address[0]}:{s.port}/metrics" for s in sinks)
            if api.swarm is not None:  # nodes join it: echorl node --bootstrap ADDR --run-id RUN
                where += f" swarm={await nursery.start(api.swarm.run)} run_id={cfg.run_id}"
            task_status.started(urls[0] + where)
    finally:
        for sink in sinks:
            sink.close()


def run(args: argparse.Namespace) -> int:
    cfg = cfgmod.configured(ServeConfig, args, "serve")
    if isinstance(cfg, int):
        return cfg
    if not cfg.api_keys:
        cfgmod.fail("serve", "--api-keys FILE is required (one tml-… key a line)")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from .sessions import KeyFileError

    try:
        if cfg.swarm:  # the learner peer's addresses: one line now, not a failure inside libp2p
            from echorl.net.addrs import checked_listen

            cfg.listen, cfg.announce = checked_listen(cfg.listen, cfg.announce)
        app, api = build(cfg)
    except (KeyFileError, ValueError, FileNotFoundError) as exc:
        cfgmod.fail("serve", exc)
        return 2

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            url, _, metrics = (await nursery.start(serve, cfg, app, api)).partition(" ")
            print(f"echorl serve: {url} base_model={api.model_name!r} {metrics}".rstrip(), flush=True)
            gc_pauses.after_start_up()  # the base model and the endpoint are up: out of full collections' reach

    try:
        trio.run(main)
    except KeyboardInterrupt:
        return 0
    except BaseExceptionGroup as group:  # trio's nurseries group what they raise
        bind = group.subgroup(OSError)
        if bind is not None:
            exc = bind.exceptions[0]
            while isinstance(exc, BaseExceptionGroup):
                exc = exc.exceptions[0]
            if isinstance(exc, MetricsPortError):
                print(f"echorl serve: {exc}", file=sys.stderr)
                return 2
            print(f"echorl serve: cannot listen on {cfg.host}:{cfg.port}: {exc}", file=sys.stderr)
            return 2
        if group.subgroup(KeyboardInterrupt) is not None:
            return 0
        raise
    return 0
