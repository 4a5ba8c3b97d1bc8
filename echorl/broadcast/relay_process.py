"""One broadcast relay peer as an OS process (benchmarks and tests): a libp2p host with a
``Relay`` and no torch, printing one JSON event per line on stdout.

    python -m echorl.broadcast.relay_process --learner MULTIADDR --run-id RUN [--catch-up] ...

``main(relay_class=...)`` runs another ``Relay`` subclass the same way (the tests' tampering relay).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import trio

from echorl.broadcast.relay import Relay
from echorl.broadcast.store import DEFAULT_CACHE_BYTES
from echorl.net.host import PeerUnavailable
from echorl.net.transport import UploadLimiter


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _main(args: argparse.Namespace, relay_class: type[Relay] = Relay) -> None:
    from echorl.net.host import HostConfig, open_host
    from echorl.protocol.identity import Identity

    learner_id = args.learner.rsplit("/p2p/", 1)[1]
    identity = Identity.generate()
    async with open_host(identity, HostConfig(listen=args.listen)) as host:

        def on_version(version: int, path: Path) -> None:
            # the digest the file was verified against (streamed over it before this call)
            _emit(
                {
                    "event": "version",
                    "version": version,
                    "digest": relay.result_digest.hex(),
                    "bytes": path.stat().st_size,
                    "t": time.time(),
                    "rss_mb": rss_mb(),
                    "cache_peak_mb": relay.server.store.cache.peak_bytes / 2**20,
                    "adopted": relay.feed.adopted,  # stripes completed by an ancestor, all versions
                }
            )

        relay = relay_class(
            host,
            learner_id,
            args.run_id,
            on_version=on_version,
            upload_limit=UploadLimiter.from_mbps(args.upload_mbps),
            stall_s=args.stall_s,
            direct=not args.no_direct,
            store_dir=Path(args.store_dir) if args.store_dir else None,
            cache_bytes=int(args.chunk_cache_mb * 2**20),
        )
        relay.install()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(relay.run)
            if args.catch_up:
                sources = []
                for addr in args.source:
                    try:
                        sources.append(await host.connect(addr))
                    except PeerUnavailable:
                        pass
                await host.connect(args.learner)
                # late joiner: from peers first; the learner only if none answers
                await relay.catch_up(sources)
            if args.dial_learner and not args.catch_up:  # as a node joining does: behind NAT, the only way in
                await host.connect(args.learner)
            _emit({"event": "ready", "peer_id": host.peer_id, "addrs": host.addrs, "version": relay.version})
            # exit when the parent closes our stdin
            await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
            nursery.cancel_scope.cancel()


def rss_mb(pid: int | None = None) -> float:
    """A process's resident memory (VmRSS; default: this one), in MiB; 0 where /proc is missing."""
    try:
        with open(f"/proc/{pid or os.getpid()}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration, ValueError):
        return 0.0


def main(argv: list[str] | None = None, relay_class: type[Relay] = Relay) -> None:
    ap = argparse.ArgumentParser(description="run one broadcast relay peer (bench/tests)")
    ap.add_argument("--learner", required=True, help="learner multiaddr /ip4/…/tcp/…/p2p/<id>")
    ap.add_argument("--run-id", default="bench")
    ap.add_argument("--listen", default="/ip4/127.0.0.1/tcp/0")
    ap.add_argument("--upload-mbps", type=float, default=0.0)
    ap.add_argument("--stall-s", type=float, default=10.0)
    ap.add_argument("--catch-up", action="store_true")
    ap.add_argument("--no-direct", action="store_true", help="chunks over libp2p streams only")
    ap.add_argument("--source", action="append", default=[], help="peer multiaddr to catch up from")
    ap.add_argument(
        "--dial-learner",
        action="store_true",
        help="connect to the learner before reporting ready (a peer behind NAT cannot be dialed)",
    )
    ap.add_argument("--store-dir", default="", help="weight files here (default: a temporary directory)")
    ap.add_argument(
        "--chunk-cache-mb",
        type=float,
        default=DEFAULT_CACHE_BYTES / 2**20,
        help="memory for chunk frames in transit (the rest is read from the store's files)",
    )
    args = ap.parse_args(argv)
    # ECHORL_RELAY_LOG=info: what each stripe's feed did (adopted by whom, what was pulled) in the logs
    level = os.environ.get("ECHORL_RELAY_LOG", "warning").upper()
    logging.basicConfig(level=level if level in ("DEBUG", "INFO", "WARNING") else "WARNING", stream=sys.stderr)
    profile = os.environ.get("ECHORL_RELAY_PROFILE")  # a directory: one cProfile dump per process
    if profile:
        import cProfile

        cProfile.runctx(
            "trio.run(_main, args, relay_class)",
            globals(),
            {"trio": trio, "_main": _main, "args": args, "relay_class": relay_class},
            os.path.join(profile, f"relay-{os.getpid()}.prof"),
        )
    else:
        trio.run(_main, args, relay_class)


if __name__ == "__main__":
    main()
