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
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    import torch

    from echorl.actor.backend import TorchBackend
    from echorl.actor.types import RolloutGroup
    from echorl.rl.seams import Tokenizer

log = logging.getLogger(__name__)

Snapshots = Callable[[int], "bytes | None"]


@dataclass(frozen=True)
class SeedProof:
    """What the sampling replay needs: the lease's seed, its top-p, and each prompt's index in the
    lease (sample ``k·G + j`` is draw j of the lease's prompt k, ``actor/seeded.py``)."""

    seed: int
    top_p: float
    prompt_index: dict[str, int]
    group_size: int


@dataclass
class SpotResult:
    ok: bool
    max_abs_diff: float
    mean_abs_diff: float
    tokens: int
    skipped: bool = False  # the claimed version's snapshot is no longer held: nothing checked
    seconds: float = 0.0  # wall time of the check (worker thread), snapshot loading included
    replayed: int = 0  # positions whose seeded choice was replayed (0: no sampling proof ran)
    misses: int = 0  # of those, positions whose token is not the seeded choice within tolerance
    max_gap: float = 0.0  # largest Gumbel-max gap seen (0 for an engine with the learner's logits)
    sampled: bool = True  # the misses are within the calibrated bound (learner/tolerances.py)


class SpotChecker:
    """Recomputes behaviour log-probs of a fraction of submissions (see the module docstring).

    ``model``: a zero-argument factory returning a fresh model of the run's architecture
    (called lazily, in the worker thread, on the first check), or a template ``nn.Module``
    that is deep-copied at construction — construct it before training starts, never while
    another thread trains the template. ``snapshots(version)`` returns that version's
    safetensors bytes or None; it is called from the worker thread, so it must be thread-safe
    (the learner's ``Broadcaster.version_bytes`` is: it rebuilds the version from the one chunk
    store the broadcast serves from). ``fraction`` of submissions are checked at random; every
    submission of a flagged peer is checked (``should_check(flagged=True)``).
    """

    def __init__(
        self,
        model: torch.nn.Module | Callable[[], torch.nn.Module],
        tokenizer: Tokenizer,
        temperature: float,
        fraction: float,
        snapshots: Snapshots,
        *,
        tolerance_mean: float = 0.02,
        tolerance_max: float = 0.5,
        micro_batch: int = 64,
        rng: random.Random | None = None,
    ) -> None:
        import torch

        if isinstance(model, torch.nn.Module):
            template = copy.deepcopy(model).eval().requires_grad_(False)
            self._factory: Callable[[], torch.nn.Module] = lambda: template
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
        self._backend: TorchBackend | None = None  # over the scratch model (built in the worker thread)
        self._loaded = -1  # version currently in the scratch model
        self._limiter = trio.CapacityLimiter(1)  # one check at a time (one scratch model)
        self._thread_lock = threading.Lock()

    def should_check(self, flagged: bool = False) -> bool:
        """Whether to check a submission: always for a ``flagged`` peer (the peer book keeps
        flags), else with probability ``fraction``."""
        if flagged:
            return True
        return self.fraction > 0 and (self.fraction >= 1.0 or self.rng.random() < self.fraction)

    async def check(
        self,
        groups: list[RolloutGroup],
        behaviour_version: int,
        engine: str = "torch",
        dtype: str | None = None,
        proof: SeedProof | None = None,
    ) -> SpotResult:
        """Recompute and compare (in a worker thread); ``skipped`` if the snapshot is gone.
        ``engine``/``dtype``: what the node declared (its capability record), which picks the
        tolerance (``learner/tolerances.py``); ``proof``: also replay the seeded choice of every
        model token from the same logits (one prefill for both)."""
        return await trio.to_thread.run_sync(
            self.check_sync, groups, behaviour_version, engine, dtype, proof, limiter=self._limiter
        )

    # --- worker thread ------------------------------------------------------------------------
    def check_sync(
        self,
        groups: list[RolloutGroup],
        behaviour_version: int,
        engine: str = "torch",
        dtype: str | None = None,
        proof: SeedProof | None = None,
    ) -> SpotResult:
        from echorl.learner.tolerances import Tolerance, proof_tolerance, tolerance_for

        with self._thread_lock:
            t0 = time.perf_counter()
            backend = self._load(behaviour_version)
            if backend is None:
                return SpotResult(True, 0.0, 0.0, 0, skipped=True, seconds=time.perf_counter() - t0)
            max_d, sum_d, n, gaps = self._compare(backend, groups, proof)
            mean_d = sum_d / n if n else 0.0
            checker_dtype = str(next(backend.model.parameters()).dtype).removeprefix("torch.")
            tol = tolerance_for(engine, dtype, Tolerance(self.tolerance_mean, self.tolerance_max), checker_dtype)
            ok = mean_d <= tol.mean and max_d <= tol.max
            proof_tol = proof_tolerance(engine, dtype, checker_dtype)
            misses = sum(g > proof_tol.gap for g in gaps)
            return SpotResult(
                ok,
                max_d,
                mean_d,
                n,
                seconds=time.perf_counter() - t0,
                replayed=len(gaps),
                misses=misses,
                max_gap=max(gaps, default=0.0),
                sampled=proof_tol.holds(misses, len(gaps)),
            )

    def replay_gaps(self, groups: list[RolloutGroup], behaviour_version: int, proof: SeedProof) -> list[float] | None:
        """Every model token's Gumbel-max gap (the raw data of the calibration,
        ``bench/cheaters.py``); None: the version's snapshot is gone."""
        with self._thread_lock:
            backend = self._load(behaviour_version)
            return None if backend is None else self._compare(backend, groups, proof)[3]

    def _load(self, version: int) -> TorchBackend | None:
        """The scratch backend holding ``version`` (None: its snapshot is gone)."""
        from echorl.actor.backend import TorchBackend
        from echorl.protocol import snapshot

        if self._backend is not None and self._loaded == version:
            return self._backend
        data = self.snapshots(version)
        if data is None:
            return None
        if self._backend is None:
            model = self._factory().eval().requires_grad_(False)
            self._backend = TorchBackend(model, self.tokenizer)
        self._loaded = -1  # a failed load leaves the scratch model in an unknown state
        self._backend.load_state_dict(snapshot.safetensors_to_state_dict(data), version)
        self._loaded = version
        return self._backend

    def _compare(
        self, backend: TorchBackend, groups: list[RolloutGroup], proof: SeedProof | None = None
    ) -> tuple[float, float, int, list[float]]:
        """Largest and summed |Δ log-prob| and the token count; with a ``proof``, the Gumbel-max
        gap of every model token (``actor/seeded.py``) from the same logits."""
        import torch

        from echorl.actor.seeded import row_key, sampling_gaps

        rows = [
            (list(g.prompt_token_ids), list(s.token_ids), list(s.logprobs), s.mask, self._sample(proof, g, j))
            for g in groups
            for j, s in enumerate(g.samples)
            if s.token_ids and g.prompt_token_ids
        ]
        model, pad = backend.model, backend.pad_id
        temp = self.temperature if self.temperature > 0 else 1.0
        max_d, sum_d, n = 0.0, 0.0, 0
        gaps: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(rows), self.micro_batch):
                chunk = rows[start : start + self.micro_batch]
                width = max(len(r[0]) + len(r[1]) for r in chunk)
                ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                att = torch.zeros((len(chunk), width), dtype=torch.long)
                cmask = torch.zeros((len(chunk), width - 1), dtype=torch.bool)
                claimed = torch.zeros((len(chunk), width - 1))
                for i, (p, c, lp, m, _) in enumerate(
                    chunk
                ):  # m: an episode's model mask (observations are not the model's)
                    ids[i, : len(p) + len(c)] = torch.tensor(p + c)
                    att[i, : len(p) + len(c)] = 1
                    cmask[i, len(p) - 1 : len(p) - 1 + len(c)] = (
                        True if m is None else torch.tensor(m, dtype=torch.bool)
                    )
                    claimed[i, len(p) - 1 : len(p) - 1 + len(c)] = torch.tensor(lp, dtype=torch.float32)
                dev = backend.device
                logits = model(input_ids=ids.to(dev), attention_mask=att.to(dev)).logits[:, :-1].float()
                logp = torch.log_softmax(logits / temp, dim=-1).gather(-1, ids[:, 1:, None].to(dev)).squeeze(-1).cpu()
                diff = (logp.clamp(max=0.0) - claimed.clamp(max=0.0)).abs()[cmask]
                diff = torch.nan_to_num(diff, nan=float("inf"))
                if diff.numel():
                    max_d = max(max_d, float(diff.max()))
                    sum_d += float(diff.sum())
                    n += int(diff.numel())
                if proof is not None:
                    keys = [
                        row_key(proof.seed, r[4], t) for r in chunk for t in range(len(r[1])) if r[3] is None or r[3][t]
                    ]
                    picked = cmask.to(dev)
                    gap = sampling_gaps(logits[picked], ids[:, 1:].to(dev)[picked], keys, self.temperature, proof.top_p)
                    gaps.extend(torch.nan_to_num(gap, nan=float("inf")).tolist())
        return max_d, sum_d, n, gaps

    @staticmethod
    def _sample(proof: SeedProof | None, group: RolloutGroup, j: int) -> int:
        """The sample index of draw ``j`` of ``group`` in its lease (-1 without a proof)."""
        if proof is None:
            return -1
        return proof.prompt_index[group.prompt_id] * proof.group_size + j
