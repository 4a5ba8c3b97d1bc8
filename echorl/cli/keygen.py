"""``echorl keygen``: create (or show) the persistent Ed25519 key a peer runs with."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from echorl.protocol.identity import load_identity, load_or_create_identity

DEFAULT_KEY = Path.home() / ".config" / "echorl" / "node.key"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--key",
        type=Path,
        default=DEFAULT_KEY,
        help=f"key file (32-byte seed, mode 0600); created if missing (default: {DEFAULT_KEY})",
    )
    parser.add_argument("--show", action="store_true", help="only show an existing key's peer ID; never create")
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of the bare peer ID")


def run(args: argparse.Namespace) -> int:
    try:
        identity = load_identity(args.key) if args.show else load_or_create_identity(args.key)
    except (OSError, ValueError) as exc:  # KeyFileError: the one wording of every key problem
        print(f"echorl keygen: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"key": str(args.key), "peer_id": identity.peer_id}) if args.json else identity.peer_id)
    return 0
