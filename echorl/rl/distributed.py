"""Data-parallel GRPO over ``torch.distributed``: ``--nproc N`` trains each batch on N ranks.

Rank 0 is the process that does everything else (the learner peer's trio networking, service and
publisher, or train-local's actor loop); ranks 1..N-1 are worker processes it starts
(``python -m echorl.rl.distributed``) that only train. One step (:meth:`DistributedGRPO.train_step`):

1. rank 0 validates the batch (``GRPOTrainer.prepare``) and splits it into N shares of whole
   groups balanced by token count (:func:`split_shares`);
2. it tells the workers "step" and scatters the shares (msgpack bytes in a tensor,
   ``rl/collectives.py``: no object collective pickles anything; in-process data already
   checked, never bytes from the network);
3. every rank runs forward/backward on its share with the loss normalised by the *batch-wide*
   token (sequence) count, so the shares' gradients sum to the whole batch's gradient;
4. one bucketed ``all_reduce`` (sum) of the gradients and of the step statistics;
5. every rank clips and steps its own AdamW on identical gradients, so the replicas stay
   bit-identical (:meth:`DistributedGRPO.ranks_in_sync` checks it).

Replicas, not FSDP2's ``fully_shard``: FSDP2 runs on CPU with gloo in torch 2.13, but a sharded
model cannot be used by rank 0 alone, and rank 0 uses the policy alone between steps (held-out
evaluation by generation, the spot checker's scratch copy, each publication's state dict): every
one of those would become a collective the workers join. Replicas keep rank 0's model an
ordinary module; the cost is that every rank holds the whole model and optimizer. The gradients
are all-reduced once per step, after all micro-batches (what DDP does under ``no_sync`` plus a
last synchronised backward); doing it by hand also lets a rank with an empty share (fewer groups
than ranks) join with zero gradients, where DDP's autograd hooks need a forward on every rank.

The rendezvous is a ``FileStore`` in a private directory of this run (mode 0700, removed at
``close``): no rendezvous port listens, and only this user's processes can reach it. gloo's (and
NCCL's bootstrap) sockets between the ranks bind the loopback interface (``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME``, unless set). Commands go through the store (key ``echorl/cmd``, JSON
``[seq, command, arg]``): a worker polls it, idle for as long as rank 0 collects rollouts, and
notices within seconds if rank 0 is gone. Collectives run on the process group whose ``timeout``
is the step deadline: a worker that died, hangs or sends garbage makes rank 0's step raise
:class:`DistributedError` within ``timeout_s``, never hang; the training loop then checkpoints and
ends the run with one log line (``rl/loop.py``). After such an error the replicas' state is
undefined and the object refuses further steps.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echorl.rl.collectives import (
    Share,
    all_digests,
    broadcast_optimizer,
    pack_share,
    param_digest,
    scatter_bytes,
    split_shares,
    unpack_share,
)
from echorl.rl.grpo import STAT_KEYS, GRPOConfig, GRPOTrainer

if TYPE_CHECKING:
    import torch
    from torch.distributed import Store

    from echorl.actor.types import RolloutGroup

STEP_TIMEOUT_S = 300.0
"""Default deadline of one step's collectives (a slow step on a big model must fit in it)."""
START_TIMEOUT_S = 300.0
"""Default deadline for every worker to load the model and join."""
BUCKET_ELEMS = 1 << 22
"""Gradient elements per all-reduce (16 MiB in float32): bounds the extra memory of a flat copy."""
_POLL_S = 2.0
"""How often an idle worker checks that rank 0 is still there."""
COMMAND_KEY = "echorl/cmd"
"""The store key rank 0 posts each command under, as JSON ``[seq, command, arg]``."""
_COMMAND_POLL_S = 0.02
"""How often a worker looks for rank 0's next command."""
LOOPBACK = "lo0" if sys.platform == "darwin" else "lo"
"""The loopback interface the ranks' own sockets bind (gloo, NCCL's bootstrap)."""


class DistributedError(RuntimeError):
    """A worker rank died, did not answer in time, or could not start; the step did not complete."""


@dataclass
class WorkerSpec:
    """What a worker needs to build its replica (rank 0's weights overwrite it at start)."""

    model: str
    grpo: dict[str, Any]
    seed: int
    timeout_s: float
    start_timeout_s: float
    threads: int

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))

    def grpo_config(self, device: str) -> GRPOConfig:
        d = dict(self.grpo, device=device)
        d["betas"] = tuple(d["betas"])
        d["entropy_tokens"] = tuple(d["entropy_tokens"])
        return GRPOConfig(**d)


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: CPU for all, or the ``rank``-th GPU after ``device``'s index."""
    if not device.startswith("cuda"):
        return device
    import torch

    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{(base + rank) % max(1, torch.cuda.device_count())}"


def check_world(device: str, nproc: int) -> None:
    """Refuse a world the devices cannot hold: NCCL needs one GPU per rank."""
    if nproc < 1:
        raise ValueError("nproc must be >= 1")
    if device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < nproc:
            raise ValueError(f"--nproc {nproc} on {device} needs {nproc} GPUs, {torch.cuda.device_count()} visible")


# --- what every rank runs ---------------------------------------------------------------------
def _sync_gradients(params: list[torch.Tensor]) -> None:
    """Sum the gradients over ranks; a parameter no rank has a gradient for keeps ``None``
    (so AdamW skips it, as it would on one rank)."""
    import torch
    import torch.distributed as dist

    has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=params[0].device)
    dist.all_reduce(has)
    for bucket in _buckets(params):
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        dist.all_reduce(flat)
        off = 0
        for p in bucket:
            g = flat[off : off + p.numel()].view_as(p)
            off += p.numel()
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
    for p, h in zip(params, has.tolist()):
        if h == 0:
            p.grad = None


def _buckets(params: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        if bucket and (size + p.numel() > BUCKET_ELEMS or p.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += p.numel()
    if bucket:
        yield bucket


def _train_share(trainer: GRPOTrainer, share: Share) -> tuple[dict[str, float], float | None]:
    """This rank's part of a step: accumulate its share, sum gradients and statistics, step
    (or, on a non-finite summed loss or gradient, skip on every rank alike: grad norm None)."""
    import torch
    import torch.distributed as dist

    rows, advs, n_tokens, n_seqs = share
    trainer.optimizer.zero_grad(set_to_none=True)
    sums = trainer.accumulate(rows, advs, n_tokens, n_seqs)
    _sync_gradients([p for p in trainer.model.parameters() if p.requires_grad])
    stats = torch.tensor([sums[k] for k in STAT_KEYS], dtype=torch.float64, device=trainer.config.device)
    dist.all_reduce(stats)
    sums = dict(zip(STAT_KEYS, stats.tolist()))
    return sums, trainer.finish_step(sums["loss"])


def _broadcast_weights(trainer: GRPOTrainer) -> None:
    """Rank 0's weights (and reference model) into every replica."""
    import torch
    import torch.distributed as dist

    models = [trainer.model] + ([trainer.ref_model] if trainer.ref_model is not None else [])
    with torch.no_grad():
        for m in models:
            for t in [*m.parameters(), *m.buffers()]:
                dist.broadcast(t.data, 0)


def _file_store(path: str, world: int, timeout_s: float) -> Store:
    import torch.distributed as dist

    store = dist.FileStore(path, world)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def _init_group(store: Store, device: str, rank: int, world: int, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK)  # the ranks' own sockets: loopback only
    os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


# --- rank 0 ------------------------------------------------------------------------------------
def data_parallel(
    trainer: GRPOTrainer, model_source: str | Path, nproc: int, seed: int = 0
) -> GRPOTrainer | DistributedGRPO:
    """``trainer`` itself for one process, else a :class:`DistributedGRPO` training it on
    ``nproc`` ranks; both have the same interface, ``close()`` included."""
    return trainer if nproc <= 1 else DistributedGRPO(trainer, model_source, nproc, seed)


class DistributedGRPO:
    """Rank 0's :class:`GRPOTrainer` trained data-parallel with ``nproc - 1`` worker processes.

    The same interface as the trainer it wraps (``train_step``, ``state_dict``, ``load_state``,
    ``version``, ``model``, ``optimizer``, ``config``); ``model`` stays rank 0's whole replica.
    ``model_source`` is the local model directory every worker loads its replica from (rank 0's
    weights then replace it). Use as a context manager or call :meth:`close`.
    """

    def __init__(
        self,
        trainer: GRPOTrainer,
        model_source: str | Path,
        nproc: int,
        seed: int = 0,
        timeout_s: float = STEP_TIMEOUT_S,
        start_timeout_s: float = START_TIMEOUT_S,
        threads: int = 1,
    ) -> None:
        import torch.distributed as dist

        if nproc < 2:
            raise ValueError("DistributedGRPO needs nproc >= 2 (one rank is a plain GRPOTrainer)")
        check_world(trainer.config.device, nproc)
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already runs in this process")
        self.trainer, self.nproc, self.timeout_s = trainer, nproc, timeout_s
        self._failed: str | None = None
        self._seq = 0
        spec = WorkerSpec(str(model_source), asdict(trainer.config), seed, timeout_s, start_timeout_s, threads)
        self._dir = tempfile.mkdtemp(prefix="echorl-dp-")  # mode 0700: this user's processes only
        store_path = os.path.join(self._dir, "store")
        self.procs: list[subprocess.Popen[bytes]] = []
        try:
            self._store = _file_store(store_path, nproc, start_timeout_s)
            env = dict(os.environ, ECHORL_DP_STORE=store_path, WORLD_SIZE=str(nproc))
            self.procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "echorl.rl.distributed", spec.to_json()],
                    env=dict(env, RANK=str(r)),
                    stdin=subprocess.DEVNULL,
                )
                for r in range(1, nproc)
            ]
            self._wait_ready(start_timeout_s)
            _init_group(self._store, trainer.config.device, 0, nproc, timeout_s)
            with self._collective("start"):
                _broadcast_weights(trainer)
        except BaseException:
            self.close()
            raise
        print(
            f"echorl: learner data-parallel on {nproc} ranks ({dist.get_backend()}), worker pids "
            f"{[p.pid for p in self.procs]}",
            file=sys.stderr,
            flush=True,
        )

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        keys = [f"echorl/ready{r}" for r in range(1, self.nproc)]
        while not self._store.check(keys):
            dead = self._dead()
            if dead:
                raise DistributedError(f"worker rank failed to start: {dead}")
            if time.monotonic() > deadline:
                raise DistributedError(f"workers not ready within {timeout_s:.0f} s")
            time.sleep(0.1)

    def _dead(self) -> str:
        return ", ".join(
            f"rank {r} exited with code {p.returncode}" for r, p in enumerate(self.procs, 1) if p.poll() is not None
        )

    def _send(self, cmd: str, arg: int | None = None) -> None:
        """Post the next command over the previous one (every worker has read that one, since
        the collectives that followed it completed)."""
        self._seq += 1
        self._store.set(COMMAND_KEY, json.dumps([self._seq, cmd, arg]))

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        """Run one command's collectives; any failure is fatal and names the worker at fault."""
        if self._failed:
            raise DistributedError(f"data-parallel learner is down: {self._failed}")
        dead = self._dead()
        if dead:
            self._fail(f"{what}: {dead}")
        try:
            yield
        except Exception as exc:
            time.sleep(0.2)  # let a dying worker's exit code arrive
            self._fail(f"{what}: {self._dead() or f'no answer within {self.timeout_s:.0f} s ({exc})'}", exc)

    def _fail(self, why: str, cause: BaseException | None = None) -> None:
        self._failed = why
        self.close()
        raise DistributedError(f"data-parallel learner failed at {why}") from cause

    # --- the GRPOTrainer interface -------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def model(self) -> torch.nn.Module:
        model: torch.nn.Module = self.trainer.model
        return model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    @property
    def config(self) -> GRPOConfig:
        return self.trainer.config

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.trainer.state_dict()

    def published_state(self) -> dict[str, torch.Tensor]:
        return self.trainer.published_state()

    def config_dict(self) -> dict[str, Any]:
        return self.trainer.config_dict()

    def train_step(self, groups: list[RolloutGroup]) -> dict[str, Any]:
        """One optimizer step of every rank on ``groups``. A batch that fails validation raises
        ``ValueError`` before any rank is involved, and changes nothing."""

        t0 = time.perf_counter()
        prep = self.trainer.prepare(groups)
        if not prep.rows:
            return self.trainer.skipped("empty", t0)
        n_tokens, n_seqs = prep.n_tokens, float(len(prep.rows))
        shares = [
            ([prep.rows[i] for i in s], [prep.advs[i] for i in s], n_tokens, n_seqs)
            for s in split_shares(prep, self.nproc)
        ]
        device = self.trainer.config.device
        with self._collective(f"step {self.version + 1}"):
            self._send("step")
            mine = unpack_share(scatter_bytes([pack_share(share) for share in shares], device))
            sums, grad_norm = _train_share(self.trainer, mine)
        if grad_norm is None:
            return self.trainer.skipped("nonfinite", t0, loss=sums["loss"])
        return {**self.trainer.step_metrics(prep, sums, grad_norm, t0), "ranks": self.nproc}

    def load_state(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any], version: int) -> None:
        """Load a checkpoint into rank 0 and copy weights and optimizer state to every rank."""
        self.trainer.load_state(model_state, optimizer_state, version)
        with self._collective("load"):
            self._send("load", int(version))
            _broadcast_weights(self.trainer)
            broadcast_optimizer(self.trainer.optimizer, self.trainer.config.device)

    def ranks_in_sync(self) -> bool:
        """Whether every replica's parameters are bit-identical to rank 0's."""
        with self._collective("check"):
            self._send("check")
            digests = all_digests(param_digest(self.trainer.model), self.trainer.config.device)
        return len(set(digests)) == 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (kill those that do not exit in ``timeout_s``) and leave the group."""
        import torch.distributed as dist

        if self._failed is None and any(p.poll() is None for p in self.procs):
            try:
                self._send("stop")
            except Exception:
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            if self._failed is None:
                try:
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self._dir, ignore_errors=True)
        self._failed = self._failed or "closed"

    def __enter__(self) -> DistributedGRPO:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- ranks 1..N-1 ------------------------------------------------------------------------------
def _next_command(store: Store, seq: int) -> tuple[str, int | None]:
    """Wait for command ``seq``; give up (``stop``) when rank 0 (the parent) is gone."""
    parent = os.getppid()
    last_check = time.monotonic()
    while True:
        try:
            posted, cmd, arg = json.loads(store.get(COMMAND_KEY)) if store.check([COMMAND_KEY]) else (0, "", None)
        except (RuntimeError, ValueError):  # the store file went away with rank 0
            return "stop", None
        if posted == seq:
            return str(cmd), None if arg is None else int(arg)
        if posted > seq:
            raise RuntimeError(f"command {posted} posted while waiting for {seq}")
        if time.monotonic() - last_check > _POLL_S:
            if os.getppid() != parent or os.getppid() == 1:
                return "stop", None
            last_check = time.monotonic()
        time.sleep(_COMMAND_POLL_S)


def worker_main(spec: WorkerSpec) -> int:
    """Rank ``$RANK`` of ``$WORLD_SIZE``: build the replica, then follow rank 0's commands.
    Ctrl-C reaches the whole process group: only rank 0 acts on it (it finishes the step it is
    in, checkpoints, then sends "stop"), so a worker ignores SIGINT."""
    import signal

    import torch
    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    device = rank_device(spec.grpo["device"], rank)
    trainer = GRPOTrainer(spec.model, spec.grpo_config(device))
    store = _file_store(os.environ["ECHORL_DP_STORE"], world, spec.start_timeout_s)
    store.set(f"echorl/ready{rank}", "1")
    _init_group(store, device, rank, world, spec.timeout_s)
    try:
        _broadcast_weights(trainer)
        seq = 0
        while True:
            seq += 1
            cmd, arg = _next_command(store, seq)
            if cmd == "stop":
                return 0
            if cmd == "step":
                _train_share(trainer, unpack_share(scatter_bytes(None, device)))
            elif cmd == "load" and arg is not None:
                _broadcast_weights(trainer)
                optimizer_state = broadcast_optimizer(trainer.optimizer, device)
                assert optimizer_state is not None
                trainer.load_state(trainer.model.state_dict(), optimizer_state, arg)
            elif cmd == "check":
                all_digests(param_digest(trainer.model), device)
            else:
                raise RuntimeError(f"unknown command {cmd!r} from rank 0")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or "RANK" not in os.environ or "ECHORL_DP_STORE" not in os.environ:
        print(
            "usage: RANK=r WORLD_SIZE=n ECHORL_DP_STORE=FILE python -m echorl.rl.distributed SPEC_JSON"
            " (started by DistributedGRPO, not by hand)",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return worker_main(WorkerSpec.from_json(argv[0]))


if __name__ == "__main__":
    sys.exit(main())
