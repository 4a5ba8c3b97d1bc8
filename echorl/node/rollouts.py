"""The node's work: its inference backend and capability record, and one lease done — generate
(single-turn prompts or multi-turn episodes, in a worker thread), sign, submit, and keep the
learner's verified receipt (``node/receipts.py``)."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import trio

from echorl.node.config import NodeConfig
from echorl.node.progress import NodeState

log = logging.getLogger(__name__)


def capability(cfg: NodeConfig, tokens_per_s: float, addrs: list[str]) -> Any:
    import torch

    from echorl.protocol.messages import Capability

    if cfg.device.startswith("cuda"):
        device = torch.cuda.get_device_name(torch.device(cfg.device))
        memory = int(torch.cuda.get_device_properties(torch.device(cfg.device)).total_memory)
    else:
        device = "cpu"
        memory = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return Capability(
        engine=cfg.engine,
        device=device,
        memory_bytes=memory,
        tokens_per_s=float(tokens_per_s),
        price_per_hour=float(cfg.price_per_hour),
        reachable=True,
        listen_addrs=addrs[:16],
        dtype=cfg.dtype,
    )


def load_backend(cfg: NodeConfig) -> tuple[Any, float]:
    """The inference backend (``InferenceBackend``: version, load_state_dict, generate) and its
    measured tokens/s. vLLM is imported only when chosen; that path is untested here (no GPU)."""
    import torch

    from echorl.actor.backend import measure_tokens_per_second
    from echorl.actor.model import default_model

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    path = cfg.model or str(default_model())
    if cfg.engine == "vllm":
        from echorl.actor.vllm_backend import VLLMBackend

        backend: Any = VLLMBackend(path, gpu_memory_utilization=cfg.vllm_gpu_memory, dtype=cfg.dtype, seed=cfg.seed)
    else:
        from echorl.actor.backend import TorchBackend

        backend = TorchBackend.from_pretrained(path, device=cfg.device, dtype=cfg.dtype)
    return backend, measure_tokens_per_second(backend)


MAX_ENVIRONMENTS = 8  # built environments kept (one per spec and options; the oldest goes first)


class EnvironmentRefused(Exception):
    """A lease names an environment this node does not run (not built in, not ``--allow-env``)
    or cannot build with the given options."""


def environment(state: NodeState, spec: Any) -> Any:
    """The episodic task of a lease's ``EpisodeSpec`` (built once per spec and options)."""
    from echorl.tasks import BUILTIN, TaskError, is_episodic, load_task

    key = repr((spec.env, sorted(spec.options.items())))
    if key not in state.envs:
        if spec.env not in BUILTIN and spec.env not in state.allow_env:
            raise EnvironmentRefused(f"environment {spec.env!r} is neither built in nor allowed (--allow-env)")
        try:
            task = load_task(spec.env, **{**spec.options, "max_turns": spec.max_turns})
        except TaskError as exc:
            raise EnvironmentRefused(f"environment {spec.env!r}: {exc}") from None
        if not is_episodic(task):
            raise EnvironmentRefused(f"{spec.env!r} is not an environment")
        while len(state.envs) >= MAX_ENVIRONMENTS:  # options change over a run (self-play's opponent)
            state.envs.pop(next(iter(state.envs)))
        state.envs[key] = task
    return state.envs[key]


async def generate_and_submit(host: Any, state: NodeState, lease: Any) -> Any:
    import secrets

    from echorl.actor.types import SamplingParams
    from echorl.net.host import RemoteError
    from echorl.protocol import routes, wire
    from echorl.protocol.messages import RolloutGroup, Sample, Submit, SubmitAccepted

    sp = lease.sampling
    params = SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, max_new_tokens=sp.max_new_tokens, stop=list(sp.stop)
    )
    t0 = time.perf_counter()
    episode = lease.prompts[0].episode
    if episode is None:
        version, incarnation, groups = await state.weights.generate(
            [p.text if p.token_ids is None else list(p.token_ids) for p in lease.prompts],
            lease.group_size,
            params,
            None,
            lease.sampling_seed,
        )
    else:
        from echorl.actor.episodes import run_episodes

        task = environment(state, episode)
        specs = [p.episode or episode for p in lease.prompts]
        if any(s.env != episode.env for s in specs):
            raise EnvironmentRefused("a lease's prompts name more than one environment")
        seeds = [s.seed for s in specs]
        version, incarnation, (_, groups) = await state.weights.run(
            run_episodes,
            state.weights.backend,
            task,
            seeds,
            lease.group_size,
            params,
            episode.max_tokens,
            None,
            lease.sampling_seed,
            [dict(s.options) for s in specs],  # each prompt's own (self-play: the opponent it was dealt)
        )
    seconds = time.perf_counter() - t0
    wire_groups = [
        RolloutGroup(
            prompt_id=p.prompt_id,
            samples=[
                Sample(
                    token_ids=list(s.token_ids),
                    logprobs=[min(0.0, float(x)) for x in s.logprobs],
                    finish_reason=s.finish_reason if s.finish_reason in ("stop", "length", "eos") else "stop",
                    reward_hint=float(s.reward or 0.0),
                    model_mask=s.mask,
                )
                for s in g
            ],
        )
        for p, g in zip(lease.prompts, groups)
    ]
    submit = Submit(
        run_id=state.run_id,
        lease_id=lease.lease_id,
        peer_id=host.peer_id,
        behaviour_version=version,
        groups=wire_groups,
        generate_seconds=seconds,
        nonce=secrets.token_bytes(16),
        incarnation=incarnation,
    )
    submit = await trio.to_thread.run_sync(wire.sign, submit, host.identity)
    state.groups_generated += len(wire_groups)
    state.tokens_generated += sum(len(s.token_ids) for g in wire_groups for s in g.samples)
    state.generate_seconds += seconds
    try:
        reply = await host.request(state.learner, routes.SUBMIT, submit, expect=SubmitAccepted, timeout=60)
    except RemoteError as exc:
        state.rejected[exc.code.value] = state.rejected.get(exc.code.value, 0) + 1
        state.publish()
        raise
    assert isinstance(reply, SubmitAccepted)
    await _keep_receipt(host, state, lease.lease_id, reply)
    state.publish()
    return reply


async def _keep_receipt(host: Any, state: NodeState, lease_id: str, reply: Any) -> None:
    """Verify the receipt against the pinned learner, this node, the run and the lease; append
    it to the receipts file (both in a worker thread: a signature check and an fsync)."""
    from echorl.node.receipts import check
    from echorl.protocol.errors import ProtocolError

    if reply.receipt is None:
        return
    try:
        await trio.to_thread.run_sync(check, reply.receipt, state.learner, host.peer_id, state.run_id, lease_id)
    except ProtocolError as exc:
        state.receipts_invalid += 1
        log.warning("receipt for lease %s refused: %s", lease_id, exc)
        return
    await trio.to_thread.run_sync(state.receipts.append, reply.receipt)
    state.receipts_kept += 1
    state.groups_credited += reply.receipt.groups
