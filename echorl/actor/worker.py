"""Local actor worker process (used by ``echorl train-local``): takes leases from a queue,
loads the newest *visible* published weights, samples G completions per prompt with
:class:`TorchBackend` and returns :class:`RolloutGroup` results.

Weights travel through a directory: the learner writes ``v<version>.safetensors`` atomically;
a version becomes visible to actors ``delay_s`` seconds after its file appeared, which
simulates dissemination latency so that staleness really occurs. A lease carries
``min_version``: the worker waits until a version at least that new is visible.
"""

from __future__ import annotations

import os
import queue
import re
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from echorl.tasks.base import Prompt

from .types import RolloutGroup, SamplingParams

_NAME = re.compile(r"^v(\d{8})\.safetensors$")


@dataclass
class Lease:
    """Work handed to an actor: prompts, group size, sampling parameters, minimum version."""

    lease_id: int
    prompts: list[Prompt]
    group_size: int
    params: SamplingParams
    min_version: int = 0
    env: tuple[str, dict[str, Any]] | None = None  # episodic task: (spec, options); prompts carry env seeds
    # seeded sampling (actor/seeded.py), as a network node samples a lease: train-local derives it
    # from the run's seed, the version and the lease id, so which actor takes a lease changes nothing
    sampling_seed: int | None = None


@dataclass
class LeaseResult:
    """An actor's answer to a lease (``error`` set when generation failed)."""

    lease_id: int
    actor: int
    groups: list[RolloutGroup] = field(default_factory=list)
    generate_s: float = 0.0
    wait_s: float = 0.0
    error: str | None = None


def publish_weights(weights_dir: Path, state_dict: dict[str, Any], version: int, keep: int = 8) -> Path:
    """Atomically write ``v<version>.safetensors`` and delete files older than ``keep`` versions,
    and every file newer than ``version``: a run's versions only grow, so a newer one is another
    run's (a ``--work-dir`` reused after ``--resume`` from an older checkpoint). Left there, the
    actors would load it and every rollout would claim a version the learner has not reached yet:
    each one re-queued, the run stalled for ever."""
    from safetensors.torch import save_file

    weights_dir.mkdir(parents=True, exist_ok=True)
    final = weights_dir / f"v{version:08d}.safetensors"
    fd, tmp = tempfile.mkstemp(prefix=".pub.", dir=weights_dir)
    os.close(fd)
    save_file(state_dict, tmp)
    os.replace(tmp, final)
    for p in weights_dir.iterdir():
        m = _NAME.match(p.name)
        if m and not version - keep < int(m.group(1)) <= version:
            p.unlink(missing_ok=True)
    return final


def visible_versions(weights_dir: Path, delay_s: float, now: float | None = None) -> list[tuple[int, Path]]:
    """Published versions whose file is at least ``delay_s`` old, newest first."""
    now = time.time() if now is None else now
    out = []
    for p in weights_dir.iterdir() if weights_dir.is_dir() else []:
        m = _NAME.match(p.name)
        if not m:
            continue
        try:
            if p.stat().st_mtime + delay_s <= now:
                out.append((int(m.group(1)), p))
        except FileNotFoundError:
            continue
    return sorted(out, reverse=True)


def _sync_weights(backend: Any, weights_dir: Path, delay_s: float) -> None:
    from safetensors.torch import load_file

    for version, path in visible_versions(weights_dir, delay_s):
        if version <= backend.version:
            return
        try:
            backend.load_state_dict(load_file(path), version)
            return
        except (FileNotFoundError, OSError):
            continue  # deleted under us: try the next one


def _rollouts(backend: Any, lease: Lease, envs: dict[str, Any], seed: int) -> list[list[Any]]:
    """G samples per prompt: completions, or episodes when the lease names an environment; seeded
    by ``lease.sampling_seed`` when it has one (``seed``, the actor's own, is then unused)."""
    if lease.env is None:
        texts = [p.text for p in lease.prompts]
        return backend.generate(texts, lease.group_size, lease.params, seed=seed, sampling_seed=lease.sampling_seed)
    from echorl.tasks import load_task

    from .episodes import run_episodes

    spec, options = lease.env
    key = repr((spec, sorted(options.items())))
    if key not in envs:
        envs[key] = load_task(spec, **options)
    task = envs[key]
    seeds = [int(p.meta["env_seed"]) for p in lease.prompts]
    overrides = [p.meta.get("env_options") for p in lease.prompts]
    return run_episodes(
        backend,
        task,
        seeds,
        lease.group_size,
        lease.params,
        task.max_episode_tokens,
        seed,
        lease.sampling_seed,
        env_options=overrides,
    )[1]


def actor_main(
    index: int,
    model_dir: str,
    weights_dir: str,
    lease_q: Any,
    result_q: Any,
    stop: Any,
    delay_s: float,
    seed: int,
    device: str = "cpu",
    dtype: str | None = None,
    adapter: Any = None,
) -> None:
    """Process entry point: serve leases until ``stop`` is set or a ``None`` lease arrives.
    ``device``/``dtype`` are already resolved (``actor/device.py``); ``adapter``: the run's
    ``LoraSettings`` (versions are adapters over ``model_dir``), None for full weights."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .backend import TorchBackend

    backend = TorchBackend.from_pretrained(model_dir, device=device, dtype=dtype)
    if adapter is not None:
        from .lora import adapt_backend

        backend = adapt_backend(backend, adapter)
    wdir = Path(weights_dir)
    envs: dict[str, Any] = {}
    try:
        while not stop.is_set():
            try:
                lease = lease_q.get(timeout=0.2)
            except queue.Empty:
                continue
            if lease is None:
                break
            t0 = time.perf_counter()
            _sync_weights(backend, wdir, delay_s)
            while backend.version < lease.min_version and not stop.is_set():
                time.sleep(0.005)
                _sync_weights(backend, wdir, delay_s)
            if stop.is_set():
                break
            t1 = time.perf_counter()
            try:
                texts = [p.text for p in lease.prompts]
                out = _rollouts(backend, lease, envs, seed * 1_000_003 + lease.lease_id)
                t2 = time.perf_counter()
                groups = [
                    RolloutGroup(
                        prompt_id=p.prompt_id,
                        prompt_text=p.text,
                        prompt_token_ids=backend.encode(p.text),
                        samples=samples,
                        behaviour_version=backend.version,
                        rewards=None if lease.env is None else [float(x.reward or 0.0) for x in samples],
                        timings={"generate_s": (t2 - t1) / len(texts)},
                    )
                    for p, samples in zip(lease.prompts, out)
                ]
                result_q.put(LeaseResult(lease.lease_id, index, groups, t2 - t1, t1 - t0))
            except Exception:  # report, keep serving
                result_q.put(LeaseResult(lease.lease_id, index, error=traceback.format_exc()))
    finally:
        result_q.cancel_join_thread()
