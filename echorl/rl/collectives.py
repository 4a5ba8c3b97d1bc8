"""What the data-parallel ranks exchange besides gradients (``rl/distributed.py``), as tensors:
each rank's share of a step (:func:`split_shares`: whole groups balanced by tokens) and the
optimizer state's layout as msgpack bytes, the replicas' digests as raw SHA-256 bytes. No object
collective (``*_object_list``) is used: those pickle, and unpickling runs whatever a peer sends.

Every function but :func:`split_shares`, :func:`pack_share`, :func:`unpack_share` and
:func:`param_digest` is a collective: all ranks of the process group call it, in the same order.
The tensors live on ``device`` (the rank's own: NCCL needs CUDA tensors, gloo takes CPU ones).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import msgpack

from echorl.rl.grpo import Prepared, row_tokens

if TYPE_CHECKING:
    import torch

    from echorl.rl.grpo import Row

Share = tuple[list["Row"], list[float], float, float]
"""One rank's part of a step: its rows, their advantages, and the batch-wide token and sequence
counts the loss is normalised by."""


def split_shares(prep: Prepared, world: int) -> list[list[int]]:
    """Row indices per rank: whole groups, the largest (in loss tokens) first to the least
    loaded rank; rows keep their batch order within a share."""
    tokens: dict[int, int] = {}
    for g, row in zip(prep.group_of, prep.rows):
        tokens[g] = tokens.get(g, 0) + row_tokens(row)
    load, owner = [0] * world, {}
    for g in sorted(tokens, key=lambda g: (-tokens[g], g)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[g], load[r] = r, load[r] + tokens[g]
    shares: list[list[int]] = [[] for _ in range(world)]
    for i, g in enumerate(prep.group_of):
        shares[owner[g]].append(i)
    return shares


def _bytes_tensor(data: bytes, size: int, device: str) -> torch.Tensor:
    import torch

    t = torch.zeros(size, dtype=torch.uint8, device=device)
    if data:
        t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    return t


def broadcast_bytes(data: bytes | None, device: str, src: int = 0) -> bytes:
    """``data`` (given on rank ``src``) on every rank: its length, then its bytes."""
    import torch
    import torch.distributed as dist

    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(n, src)
    buf = _bytes_tensor(data or b"", int(n.item()), device)
    dist.broadcast(buf, src)
    return bytes(buf.cpu().numpy().tobytes())


def scatter_bytes(parts: list[bytes] | None, device: str) -> bytes:
    """Rank 0 gives one ``parts`` entry per rank; each rank gets its own (padded to the longest,
    the true length sent alongside)."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    size = torch.tensor([max(map(len, parts)) if parts else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, 0)
    width = int(size.item())
    mine_len = torch.zeros(1, dtype=torch.int64, device=device)
    mine = torch.zeros(width, dtype=torch.uint8, device=device)
    if rank == 0:
        assert parts is not None and len(parts) == world
        lens = [torch.tensor([len(p)], dtype=torch.int64, device=device) for p in parts]
        bufs = [_bytes_tensor(p, width, device) for p in parts]
        dist.scatter(mine_len, lens, src=0)
        dist.scatter(mine, bufs, src=0)
    else:
        dist.scatter(mine_len, None, src=0)
        dist.scatter(mine, None, src=0)
    return bytes(mine[: int(mine_len.item())].cpu().numpy().tobytes())


def pack_share(share: Share) -> bytes:
    rows, advs, n_tokens, n_seqs = share
    data: bytes = msgpack.packb([[list(r) for r in rows], list(advs), float(n_tokens), float(n_seqs)])
    return data


def unpack_share(data: bytes) -> Share:
    rows, advs, n_tokens, n_seqs = msgpack.unpackb(data)
    return [(r[0], r[1], r[2], r[3]) for r in rows], advs, float(n_tokens), float(n_seqs)


def broadcast_optimizer(optimizer: torch.optim.Optimizer, device: str) -> dict[str, Any] | None:
    """Rank 0's optimizer state, for every other rank's (identically built) optimizer: its layout
    (param groups, each state tensor's name, dtype, shape and whether it lives on the CPU) as
    msgpack bytes, then each tensor. Returns the state dict on ranks > 0 (None on rank 0)."""
    import torch
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    layout: dict[str, Any] | None = None
    sd: dict[str, Any] = {}
    if rank0:
        sd = optimizer.state_dict()
        layout = {
            "param_groups": sd["param_groups"],
            "state": {
                str(i): {k: [str(t.dtype).removeprefix("torch."), list(t.shape), t.device.type == "cpu"]
                         for k, t in sorted(s.items()) if isinstance(t, torch.Tensor)}
                for i, s in sd["state"].items()
            },
        }  # fmt: skip
    layout = msgpack.unpackb(broadcast_bytes(msgpack.packb(layout) if rank0 else None, device))
    assert layout is not None
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, tensors in layout["state"].items():
        for name, (dtype, shape, on_cpu) in tensors.items():
            t = (
                sd["state"][int(i)][name].to(device)
                if rank0
                else torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            )
            dist.broadcast(t, 0)
            state.setdefault(int(i), {})[name] = t.cpu() if on_cpu else t
    if rank0:
        return None
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in layout["param_groups"]]
    return {"state": state, "param_groups": groups}


def param_digest(model: torch.nn.Module) -> bytes:
    """SHA-256 of every parameter's bytes, in order: equal iff the replicas are bit-identical."""
    import torch

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()


def all_digests(digest: bytes, device: str) -> list[bytes]:
    """Every rank's 32-byte ``digest`` (SHA-256), by rank."""
    import torch
    import torch.distributed as dist

    mine = _bytes_tensor(digest, 32, device)
    out = [torch.zeros(32, dtype=torch.uint8, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [bytes(t.cpu().numpy().tobytes()) for t in out]
