"""The single ``echorl`` console entry: one subcommand per role.

Each subcommand lives in its plane as a module with ``add_arguments(parser)`` and
``run(args) -> int``. Only the chosen module is imported, so ``echorl --help`` stays fast and
does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module implementing it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("echorl.cli.demo", "start a learner and N node daemons on this machine and train"),
    "learner": ("echorl.learner.peer", "start the learner peer (bootstrap of a run)"),
    "node": ("echorl.node.daemon", "run a volunteer node daemon that generates rollouts"),
    "status": ("echorl.cli.status", "show peers, versions, throughput and staleness of a run"),
    "train-local": ("echorl.rl.local", "learner + actor workers in local processes, no network"),
    "doctor": (
        "echorl.cli.doctor",
        "check that this machine can be a node of a run (network, clock, key, disk, torch)",
    ),
    "ledger": ("echorl.cli.ledger", "per-node accepted and rejected work: ask the learner or verify receipts offline"),
    "plot": ("echorl.cli.plot", "draw a PNG from one or more metrics files (needs the 'plot' extra)"),
    "keygen": ("echorl.cli.keygen", "create (or show) a persistent Ed25519 peer key"),
    "serve": ("echorl.service.serve", "serve the Tinker API (tinker, logits-sdk clients): LoRA training and sampling"),
    "import-gguf": ("echorl.actor.gguf_import", "turn a local GGUF model file into an HF model directory for --model"),
    "export": ("echorl.cli.export", "write a checkpoint as a Hugging Face model directory (a LoRA adapter merged in)"),
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless its help already speaks of one or it has none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == "" or default == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def _chosen_command(argv: list[str]) -> str | None:
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="echorl",
        description="Decentralized RL post-training: a central GRPO learner, volunteer rollout "
        "nodes over libp2p, bounded policy staleness.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = _chosen_command(argv)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)
        if name == chosen:
            module = _load(module_name, name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    return parser


def _load(module_name: str, command: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            sys.exit(f"echorl {command}: not built yet ({module_name} is missing)")
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
