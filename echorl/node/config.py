"""The node's settings (``echorl node``): one pydantic model; the command line is made from it
by :mod:`echorl.common.config`. Model, device and peer fields are the shared sections of that module."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from echorl.common.config import Flag, ModelFields, PeerFields
from echorl.protocol import limits


class NodeConfig(ModelFields, PeerFields):
    """``echorl node``."""

    bootstrap: str = Field(min_length=1, max_length=1024)
    """multiaddr of a bootstrap peer (/ip4/…/tcp/…/p2p/<id>)"""
    key: str = "~/.config/echorl/node.key"
    """Ed25519 key file (created with mode 0600 if missing)"""
    learner_id: str = Field("", max_length=128)
    """pin the learner's peer ID (default: the bootstrap peer is the learner); only manifests signed by
    this peer are accepted"""
    price_per_hour: float = Field(0.0, ge=0.0, le=1e6)
    """what this node asks per hour of accepted work (capability record; the learner bills it for the
    seconds of work it accepted, at most the fleet's pace, and uses it for cost-aware scheduling)"""
    give_up_after: float = Field(300.0, ge=0.0, le=10**7)
    """exit (status 1) after this many seconds without an answer from the learner (0: never)"""
    max_prompts: int = Field(8, ge=1, le=limits.MAX_PROMPTS_PER_LEASE)
    """most prompts asked for per lease"""
    receipts: str = ""
    """file the learner's signed receipts are appended to (default: receipts.jsonl in the state dir)"""
    state_dir: str = ""
    """where the newest verified weights are kept, so a restart does not re-download them
    (default: state-<key name>-<run id> next to the --key file)"""
    allow_env: Annotated[list[str], Flag("--allow-env", metavar="MODULE:CLASS")] = Field(
        default_factory=list, max_length=64
    )
    """a user environment (module:Class) this node may run for multi-turn leases (repeatable; the
    built-in ones, e.g. poker and guess, are always allowed)"""
    engine: Literal["torch", "vllm"] = "torch"
    """inference engine: torch (transformers) or vllm (CUDA only, pip install 'echorl[vllm]'; untested here)"""
    vllm_gpu_memory: float = Field(0.5, gt=0.0, le=1.0)
    """with --engine vllm: the fraction of GPU memory vLLM may take"""
