"""``ServeConfig``: the settings of ``echorl serve`` (flags built by :mod:`echorl.common.config`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from echorl.common.config import MetricsPort, ModelFields, PeerFields
from echorl.learner.config import ServiceFields
from echorl.protocol import limits


class SwarmFields(ServiceFields, PeerFields):
    """Sampling by volunteer nodes (``--swarm``): the learner peer's settings (``echorl learner``'s
    lease, admission, policing and roster flags, with defaults for sampling) and the swarm's own."""

    swarm: bool = False
    """also be a learner peer that volunteer nodes join (``echorl node --bootstrap <printed address>
    --run-id <run id> --model <this base model's directory>``): sampling requests become leases
    they serve, verified as rollouts are; without it the server samples everything"""
    run_id: str = Field("echorl-serve", min_length=1, max_length=128)
    """identity of the swarm nodes join (``echorl node --run-id``)"""
    swarm_wait_s: float = Field(30.0, gt=0.0, le=3600.0)
    """a request the swarm has not finished after this long is finished by the server (so is every
    request while no node is active)"""
    swarm_lora_rank: int = Field(32, ge=1, le=limits.MAX_LORA_RANK)
    """LoRA rank of the adapters the swarm samples with (the attention, MLP and unembedding
    projections, the Tinker client's defaults); snapshots of any other shape are sampled by the server"""
    swarm_temperature: float = Field(1.0, gt=0.0, le=100.0)
    """the one temperature nodes sample at (the spot check replays it); other requests: the server"""
    swarm_max_tokens: int = Field(256, ge=1, le=limits.MAX_COMPLETION_TOKENS)
    """nodes sample to EOS or this many tokens, and each sample is cut to its request's max_tokens
    and stops; a request for more is sampled by the server"""
    swarm_broadcast_timeout_s: float = Field(60.0, gt=0.0, le=86_400.0)
    """give up on a snapshot's broadcast after this long (nodes still missing it fetch it)"""
    staleness: int = Field(0, ge=0, le=0)
    """always 0: a swarm lease names the newest snapshot, and only a node holding it is leased
    (exact weights; a request for an older snapshot is sampled by the server)"""
    group_size: int = Field(4, ge=2, le=limits.MAX_GROUP_SIZE)
    """samples per leased prompt (a request of n samples is ⌈n/G⌉ prompts; extra samples are unused)"""
    prompts_per_step: int = Field(64, ge=1, le=100_000)
    """prompts out to nodes at once (the in-flight bound with staleness 0)"""
    spot_check_fraction: float = Field(1.0, ge=0.0, le=1.0)
    """share of node submissions whose log-probs and seeded sampling are replayed before their
    samples go to a client (1: every one)"""


class ServeConfig(ModelFields, SwarmFields):
    """A Tinker-API endpoint over a base model this server holds."""

    api_keys: str = ""
    """file of API keys, one a line (``tml-…``, the Tinker client refuses any other form), an optional
    user name after each; required: every request needs one of them"""
    host: str = "127.0.0.1"
    """address the HTTP endpoint binds; loopback unless told otherwise"""
    port: int = Field(8420, ge=0, le=65535)
    """TCP port of the endpoint (0: any free port, printed at start)"""
    threads: int = Field(1, ge=0, le=1024)
    """torch threads of the compute worker; 1 avoids oversubscribing a shared CPU (measured: 22x
    slower sampling with 2 threads on 2 busy cores); 0: torch's default"""
    model_name: str = ""
    """the name clients pass as base_model (default: the model directory's name)"""
    state_dir: str = "runs/serve"
    """where save_state / save_weights_for_sampler write checkpoints"""
    path_scheme: Literal["echorl", "tinker"] = "echorl"
    """scheme of the checkpoint paths returned (both are accepted); the tinker client refuses
    create_sampling_client(model_path=…) unless the path starts with tinker://"""
    lora_alpha: float = Field(32.0, gt=0, le=4096)
    """LoRA alpha of every adapter (clients choose the rank)"""
    max_lora_rank: int = Field(128, ge=1, le=1024)
    """largest LoRA rank a client may ask for"""
    max_sessions: int = Field(64, ge=1, le=10_000)
    """sessions held at once"""
    max_models_per_session: int = Field(4, ge=1, le=64)
    """training clients (adapters) per session"""
    max_samplers_per_session: int = Field(32, ge=1, le=10_000)
    """sampling snapshots a session keeps (the oldest is dropped first)"""
    session_ttl_s: float = Field(1800.0, ge=10.0, le=7 * 86400.0)
    """a session without a heartbeat for this long is closed and its adapters freed"""
    max_body_mb: float = Field(64.0, gt=0, le=2048)
    """largest request body accepted (413 beyond)"""
    max_tokens_per_request: int = Field(262_144, ge=16, le=16_777_216)
    """tokens in one forward/forward_backward request or one prompt"""
    max_data_per_request: int = Field(4096, ge=1, le=1_000_000)
    """data items in one forward/forward_backward request"""
    max_new_tokens: int = Field(1024, ge=1, le=65_536)
    """cap on a sample's max_tokens"""
    max_samples: int = Field(128, ge=1, le=4096)
    """cap on num_samples of one sample request"""
    queue_size: int = Field(1024, ge=1, le=1_000_000)
    """jobs waiting for the worker; a full queue answers 429 (the client backs off)"""
    poll_wait_s: float = Field(20.0, ge=0.1, le=40.0)
    """how long a retrieve_future waits for a result before answering try_again (under the
    client's 45 s read timeout)"""
    result_keep_s: float = Field(600.0, ge=10.0, le=86400.0)
    """finished results are kept this long for retrieval"""
    price_per_hour: float = Field(1.0, ge=0.0)
    """a session's cost: its compute hours on this server times this price"""
    metrics_port: MetricsPort = ""
    """Prometheus /metrics (each session's and user's usage, docs/metrics.md) on PORT (127.0.0.1)
    or HOST:PORT; unauthenticated, so loopback unless told otherwise"""
