"""Spot checks of behaviour log-probs (architecture §3): the learner recomputes, with the snapshot of
the version a node claims, the per-token log-probs of a submission's completions and compares
them with the log-probs the node returned. A mismatch beyond tolerance means the node did not
sample from that version (or forged the numbers the clipped ratio π_θ/π_b is computed from);
the learner then refuses the submission and flags the peer (``learner/service.py``).

What is recomputed is exactly what the actor reports (``actor/backend.py``): for every
completion token (of an episode: every token its mask marks as the model's, observations are
not re-scored), ``log_softmax(logits / T)`` of the sampled token given the prompt and the
completion before it, with the lease's temperature T (T = 0 is treated as 1, as the actor
does). The model is a *scratch copy*, separate from the trainer's model: it is built once
(from a factory, or a deep copy of a template taken at construction, before training starts),
and the claimed version's safetensors bytes are loaded into it in place; the last loaded
version is cached, so consecutive checks of one version cost one forward pass each.

Everything heavy (fetching the snapshot bytes, deserialising, loading, the forward pass) runs in
a worker thread (``trio.to_thread.run_sync``), never on the trio loop, one check at a time.

Tolerances. The check passes iff mean |Δ| ≤ ``tolerance_mean`` AND max |Δ| ≤ ``tolerance_max``
over all completion tokens of the submission (Δ = recomputed − submitted, both clamped to ≤ 0
as the node clamps). Defaults 0.02 / 0.5: an honest float32 CPU actor agrees with a full
forward pass of the same weights to ~1e-5 (KV-cached, left-padded sampling vs one right-padded
pass), while a shift of a few tenths per token, or log-probs from another version, fails.
bf16/fp16 actors and vLLM disagree with a float32 recomputation by far more; their looser
bounds come from a table keyed by the (engine, dtype) the node declares
(``learner/tolerances.py``, docs/engines.md); the configured values are the float32 row and a
floor for every other row.
"""

from __future__ import annotations

import copy
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from echorl.actor.types import RolloutGroup

log = logging.getLogger("echorl.node.learner")

Snapshots = Callable[[int], "bytes | None"]


@dataclass
class SpotResult:
    ok: bool
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int
    skipped: bool = False  # the claimed version's snapshot is no longer held: nothing checked
    seconds: float = 0.0  # wall time of the check (worker thread), snapshot loading included


class SpotChecker:
    """Recomputes behaviour log-probs of a fraction of submissions (see the module docstring).

    ``model``: a zero-argument factory returning a fresh model of the run's architecture
    (called lazily, in the worker thread, on the first check), or a template ``nn.Module``
    that is deep-copied at construction — construct it before training starts, never while
    another thread trains the template. ``snapshots(version)`` returns that version's
    safetensors bytes or None; it is called from the worker thread, so it must be thread-safe
    (the learner's ``Broadcaster.version_bytes`` is: it rebuilds the version from the one chunk
    store the broadcast serves from). ``fraction`` of submissions are checked at random; every
    submission of a flagged peer is checked (``flag``).
    """

    def __init__(self, model: Any, tokenizer: Any, temperature: float, fraction: float, snapshots: Snapshots, *,
                 tolerance_mean: float = 0.02, tolerance_max: float = 0.5, micro_batch: int = 64,
                 rng: random.Random | None = None) -> None:
        import torch

        if isinstance(model, torch.nn.Module):
            template = copy.deepcopy(model).eval().requires_grad_(False)
            self._factory: Callable[[], Any] = lambda: template
        elif callable(model):
            self._factory = model
        else:
            raise TypeError("model must be an nn.Module or a zero-argument factory")
        self.tokenizer = tokenizer
        self.temperature = float(temperature)
        self.fraction = max(0.0, min(1.0, float(fraction)))
        self.snapshots = snapshots
        self.tolerance_mean = float(tolerance_mean)
        self.tolerance_max = float(tolerance_max)
        self.micro_batch = max(1, int(micro_batch))
        self.rng = rng or random.SystemRandom()
        self.flagged: set[str] = set()
        self._backend: Any = None  # TorchBackend over the scratch model (built in the worker thread)
        self._loaded = -1  # version currently in the scratch model
        self._limiter = trio.CapacityLimiter(1)  # one check at a time (one scratch model)
        self._thread_lock = threading.Lock()

    def should_check(self, peer_id: str) -> bool:
        if peer_id in self.flagged:
            return True
        return self.fraction > 0 and (self.fraction >= 1.0 or self.rng.random() < self.fraction)

    def flag(self, peer_id: str) -> None:
        self.flagged.add(peer_id)

    async def check(self, groups: list["RolloutGroup"], behaviour_version: int, engine: str = "torch",
                    dtype: str | None = None) -> SpotResult:
        """Recompute and compare (in a worker thread); ``skipped`` if the snapshot is gone.
        ``engine``/``dtype``: what the node declared (its capability record), which picks the
        tolerance (``learner/tolerances.py``)."""
        return await trio.to_thread.run_sync(self.check_sync, groups, behaviour_version, engine, dtype,
                                             limiter=self._limiter)

    # --- worker thread ------------------------------------------------------------------------
    def check_sync(self, groups: list["RolloutGroup"], behaviour_version: int, engine: str = "torch",
                   dtype: str | None = None) -> SpotResult:
        from echorl.learner.tolerances import Tolerance, tolerance_for

        with self._thread_lock:
            t0 = time.perf_counter()
            if not self._load(behaviour_version):
                return SpotResult(True, 0.0, 0.0, 0, skipped=True, seconds=time.perf_counter() - t0)
            max_d, sum_d, n = self._compare(groups)
            mean_d = sum_d / n if n else 0.0
            checker_dtype = str(next(self._backend.model.parameters()).dtype).removeprefix("torch.")
            tol = tolerance_for(engine, dtype, Tolerance(self.tolerance_mean, self.tolerance_max), checker_dtype)
            ok = mean_d <= tol.mean and max_d <= tol.max
            return SpotResult(ok, max_d, mean_d, n, seconds=time.perf_counter() - t0)

    def _load(self, version: int) -> bool:
        from echorl.actor.backend import TorchBackend
        from echorl.protocol import snapshot

        if self._backend is not None and self._loaded == version:
            return True
        data = self.snapshots(version)
        if data is None:
            return False
        if self._backend is None:
            model = self._factory().eval().requires_grad_(False)
            self._backend = TorchBackend(model, self.tokenizer)
        self._loaded = -1  # a failed load leaves the scratch model in an unknown state
        self._backend.load_state_dict(snapshot.safetensors_to_state_dict(data), version)
        self._loaded = version
        return True

    def _compare(self, groups: list["RolloutGroup"]) -> tuple[float, float, int]:
        import torch

        rows = [(list(g.prompt_token_ids), list(s.token_ids), list(s.logprobs), s.mask)
                for g in groups for s in g.samples if s.token_ids and g.prompt_token_ids]
        model = self._backend.model
        pad = self._backend.pad_id
        temp = self.temperature if self.temperature > 0 else 1.0
        max_d, sum_d, n = 0.0, 0.0, 0
        with torch.inference_mode():
            for start in range(0, len(rows), self.micro_batch):
                chunk = rows[start : start + self.micro_batch]
                width = max(len(r[0]) + len(r[1]) for r in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                att = torch.zeros((len(chunk), width), dtype=torch.long)
                cmask = torch.zeros((len(chunk), width - 1), dtype=torch.bool)
                claimed = torch.zeros((len(chunk), width - 1))
                for i, (p, c, lp, m) in enumerate(chunk):  # m: an episode's model mask (observations are not the model's)
                    ids[i, : len(p) + len(c)] = torch.tensor(p + c)
                    att[i, : len(p) + len(c)] = 1
                    cmask[i, len(p) - 1 : len(p) - 1 + len(c)] = True if m is None else torch.tensor(m, dtype=torch.bool)
                    claimed[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(lp, dtype=torch.float32)
                dev = self._backend.device
                logits = model(input_ids=ids.to(dev), attention_mask=att.to(dev)).logits[:, :-1].float()
                logp = torch.log_softmax(logits / temp, dim=-1).gather(-1, ids[:, 1:, None].to(dev)).squeeze(-1).cpu()
                diff = (logp.clamp(max=0.0) - claimed.clamp(max=0.0)).abs()[cmask]
                diff = torch.nan_to_num(diff, nan=float("inf"))
                if diff.numel():
                    max_d = max(max_d, float(diff.max()))
                    sum_d += float(diff.sum())
                    n += int(diff.numel())
        return max_d, sum_d, n
