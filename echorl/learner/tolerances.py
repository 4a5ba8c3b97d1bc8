"""Spot-check tolerances per inference engine and weight dtype (docs/engines.md).

An honest float32 torch actor agrees with the learner's float32 recomputation to ~1e-5 per
token, so the configured tolerances (``spot_check_tolerance_mean``/``_max``, 0.02 / 0.5) suit it.
A bf16 or fp16 actor, or vLLM with its own kernels, disagrees by far more while sampling honestly:
refusing it would ban every GPU volunteer. The node declares its engine and dtype in its signed
capability record; the learner looks the pair up here. The declaration cannot be verified, so a
forger can claim bf16 to get the looser bound: the table is therefore set from measurements
(``bench/logprob_drift.py``) with a margin, not wider, and even its loosest row still refuses
log-probs of another version or a shift of a few tenths on every token.

The learner's own dtype counts too: a checker running in bf16 adds its own rounding, so the
bound used is the looser of the node's row and the checker's row, and never tighter than the
configured one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """The check passes iff mean |Δ| <= ``mean`` and max |Δ| <= ``max`` (``learner/spot_check.py``)."""

    mean: float
    max: float

    def widen(self, other: Tolerance) -> Tolerance:
        return Tolerance(max(self.mean, other.mean), max(self.max, other.max))


#: (engine, dtype) -> the least tolerance an honest actor of that kind needs. float32 torch is
#: absent: it uses the configured values. Measured on CPU torch (bench/logprob_drift.py, see
#: docs/engines.md); the vLLM rows are NOT measured (no GPU here): they take the bf16 row, the
#: largest, since vLLM's kernels (fused attention, other reduction orders) add their own error.
TABLE: dict[tuple[str, str], Tolerance] = {
    ("torch", "bfloat16"): Tolerance(0.1, 2.5),
    ("torch", "float16"): Tolerance(0.03, 1.0),
    ("vllm", "float32"): Tolerance(0.1, 2.5),
    ("vllm", "bfloat16"): Tolerance(0.1, 2.5),
    ("vllm", "float16"): Tolerance(0.1, 2.5),
}

#: a declared dtype outside the table is treated as float32 (strict): an unknown kind of actor
#: earns no looser bound by naming something new
KNOWN_DTYPES = {"float32", "bfloat16", "float16"}


def tolerance_for(engine: str, dtype: str | None, base: Tolerance, checker_dtype: str = "float32") -> Tolerance:
    """The tolerance for a node's declared ``engine`` and ``dtype`` (None: float32), checked by a
    learner whose scratch model is in ``checker_dtype``; never tighter than ``base``."""
    dtype = dtype if dtype in KNOWN_DTYPES else "float32"
    engine = engine if engine == "vllm" else "torch"
    out = base.widen(TABLE.get((engine, dtype), base))
    return out.widen(TABLE.get(("torch", checker_dtype), base))


@dataclass(frozen=True)
class ProofTolerance:
    """The sampling replay (``actor/seeded.py``): a position *misses* when the submitted token's
    Gumbel-max gap exceeds ``gap``; a submission holds iff its misses are at most
    ``miss_slack + miss_fraction · positions``."""

    gap: float
    miss_fraction: float
    miss_slack: int

    def holds(self, misses: int, positions: int) -> bool:
        return misses <= self.miss_slack + self.miss_fraction * positions


#: the float32 torch row (the learner's own engine) and the row of every other declared kind,
#: calibrated by ``bench/cheaters.py --calibrate`` and ``scripts/gpu-check.sh`` on an H200
#: (docs/threat-model.md, "Seeded sampling"; 10,048 samples of each honest engine):
#:
#: * strict (gap 0.01, no miss): float32 torch on the CPU and on CUDA showed no gap above 0 on the
#:   default model and on SmolLM2-135M-Instruct (119,627 positions). A CUDA node with TF32
#:   matmuls does not meet it (largest gap 0.021; 9 of 157 SmolLM2 submissions refused), so
#:   every echorl process computes float32 at full precision (``actor/device.py:pin_device``).
#: * loose (gap 0.3, 0.3 % of the positions + 3): bf16 on CUDA against a float32 learner missed
#:   at most 3 of 746–778 positions of a SmolLM2 submission above 0.3 (0.033 % of positions,
#:   largest gap 0.87) and at most 1 of ~222 on the default model; the previous row (gap 0.1,
#:   0.5 % + 2), set from CPU bf16 on the 505k-parameter default model, refused 23 of 157
#:   honest SmolLM2 submissions (up to 10 misses above 0.1). At 0.3 the cheats a GPU makes cheap
#:   still miss 380× (temperature 0.7) and 190× (top-p 0.9) as often as honest bf16 on SmolLM2.
#:
#: What the strict row lets through is near-ties: a node with weights rounded to bf16 / int8 that
#: declares float32 passes a checked submission only where it is the honest float32 node's
#: submission token for token (76 % / 82 % of its passes) or differs by flips of ties within the
#: gap; 62 % / 79 % of its submissions that differ from the honest one are caught, and no gap
#: bound catches them all (one differed with no gap above 6e-5) (docs/threat-model.md).
PROOF = ProofTolerance(gap=0.01, miss_fraction=0.0, miss_slack=0)
PROOF_LOOSE = ProofTolerance(gap=0.3, miss_fraction=0.003, miss_slack=3)


def proof_tolerance(engine: str, dtype: str | None, checker_dtype: str = "float32") -> ProofTolerance:
    """The replay's tolerance for a node's declared ``engine``/``dtype``, checked in
    ``checker_dtype``: the strict row only when both ends are float32 torch."""
    exact = engine != "vllm" and dtype in (None, "float32") and checker_dtype == "float32"
    return PROOF if exact else PROOF_LOOSE
