"""Cheaters against the sampling replay: how often each kind of fake work is caught, how often
honest nodes are wrongly flagged, and what seeded sampling costs.

    OMP_NUM_THREADS=1 python bench/cheaters.py --json            # every class, JSON lines
    OMP_NUM_THREADS=1 python bench/cheaters.py --json --calibrate # + the per-position gap curve
    python bench/cheaters.py --json --score docs/data/h200-2026-12-04/gaps_smollm2_seed0.json \
        --rows "0.1,0.005,2;0.3,0.003,3"   # replay rows scored on saved honest gaps, nothing run

The policy is the shipped default model (2-digit addition, what the demo trains); every lease
is ``--prompts`` prompts × G=8 samples with a fresh secret seed, sampled at the learner's
default temperature 1 / top-p 1. The learner is a float32 ``SpotChecker`` over the policy's
snapshot, exactly as in a run: one prefill per submission gives both the log-prob check and the
replay of the seeded choices (``learner/spot_check.py``, ``learner/tolerances.py:PROOF``).

Cheat classes (each passes the log-prob check where it can: it reports the policy's true
log-probs of the tokens it submits, computed with one prefill):
``all_eos`` (every completion one EOS), ``other_model`` (the untrained base model's tokens,
sampled with the lease's own seeded noise), ``temperature_0.7``, ``top_p_0.9`` (the policy with
another setting, seeded), ``bf16_weights`` / ``int8_weights`` (the policy's weights rounded,
declared float32), ``replayed`` (honest completions of another lease), ``copied_answers`` (the
right answer + EOS), ``unseeded`` (today's sampler: the right distribution, not the lease's noise).
Honest nodes: ``fp32`` (the learner's engine) and ``bf16`` (weights and compute in bfloat16 on
CPU, declared: checked with the bf16 row).

Lines: one per class (``cheat``, ``submissions_checked``, ``detected_frac``, ``flagged_after``:
the expected submissions until a cheat from the start is caught, its first ``NEWCOMER_CHECKS``
all checked and the rest at the default check fraction; ``p_caught_within_3`` for it, and
``p_caught_within_3_turned`` for one that turns after its newcomer checks; and against the
honest float32 node's submission for the same lease and seed: ``submissions_differing`` (any
token differs), ``detected_frac_of_differing``, ``passed_identical_frac`` (of the submissions that
passed, those token for token the honest one), ``differing_max_gap_min`` (the smallest largest
gap of a differing submission), ``samples_per_differing_submission`` (of its G × prompts)), one per honest
engine (``honest``, ``samples_checked``, ``submissions_checked``, ``false_flags``,
``position_miss_rate``), one with ``verify_cpu_frac`` (replay CPU per submission × the check
fraction / generation CPU per submission) and ``throughput_ratio`` (seeded vs today's sampler,
same batches, same run). ``--calibrate`` adds the curve: per-position miss rates of honest
fp32/bf16 and of the weakest cheat against the gap.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import emit

G = 8
CHECK_FRACTION = 0.1  # the learner's default spot_check_fraction (learner/config.py)
CURVE = (1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.3)


class Lab:
    """The policy, the learner's checker, and the nodes of every kind.

    ``model``: an HF directory (default: the shipped default model on 2-digit addition; with a
    model, ``task`` in its chat template). The checker (the learner's float32 replay) runs on
    ``checker_device``; the honest engines (``fp32``, ``tf32``, ``bf16``) on ``node_device``, so
    a GPU node is checked by a CPU or a GPU learner exactly as in a run."""

    def __init__(
        self,
        prompts: int,
        seed: int,
        model: str | None = None,
        task: str = "addition",
        checker_device: str = "cpu",
        node_device: str = "cpu",
    ) -> None:
        from echorl.actor.backend import TorchBackend
        from echorl.actor.model import default_model
        from echorl.actor.types import SamplingParams
        from echorl.learner.spot_check import SpotChecker
        from echorl.protocol.snapshot import state_dict_to_safetensors
        from echorl.tasks import load_task
        from echorl.tasks.chat import with_chat_template

        self.path = Path(model) if model else default_model()
        self.policy = TorchBackend.from_pretrained(self.path, device=checker_device, dtype="float32")
        blob = state_dict_to_safetensors({k: v.cpu() for k, v in self.policy.model.state_dict().items()})
        self.checker = SpotChecker(self.policy.model, self.policy.tokenizer, 1.0, 1.0, lambda v: blob)
        options: dict[str, Any] = {"digits": 2} if task == "addition" else {}
        self.task = with_chat_template(load_task(task, seed=seed, **options), self.policy.tokenizer, bool(model))
        self.params = SamplingParams(temperature=1.0, max_new_tokens=self.task.max_new_tokens, stop=[])
        self.prompts = prompts
        self.rng = random.Random(seed)
        self.node_device = node_device
        self._engines: dict[str, Any] = {}

    def engine(self, kind: str) -> Any:
        """A node's engine, made once: ``fp32``/``tf32`` (float32 on the node device; ``tf32``
        runs with TF32 matmuls, :func:`matmul_precision`), ``bf16`` (bfloat16 weights and compute
        on the node device), ``bf16_weights``/``int8_weights`` (the policy rounded, float32, on
        the checker's device), ``base`` (the untrained model: the default model's random start,
        or the model's architecture at a random init)."""
        import torch

        from echorl.actor.backend import TorchBackend

        kind = "fp32" if kind == "tf32" else kind
        if kind not in self._engines:
            tok = self.policy.tokenizer
            if kind == "fp32" and self.node_device == str(self.policy.device):
                made = self.policy
            elif kind in ("fp32", "bf16"):
                dtype = torch.float32 if kind == "fp32" else torch.bfloat16
                made = TorchBackend(copy.deepcopy(self.policy.model).to(self.node_device, dtype), tok)
            elif kind in ("bf16_weights", "int8_weights"):
                made = TorchBackend(_rounded(self.policy.model, kind[: kind.index("_")]), tok)
            elif kind == "base":
                made = TorchBackend(_untrained(self.policy.model, self.path).to(self.policy.device), tok)
            else:
                raise ValueError(kind)
            self._engines[kind] = made
        return self._engines[kind]

    def lease(self) -> tuple[list[Any], int]:
        return self.task.next_prompts(self.prompts), self.rng.getrandbits(63)

    def groups(self, prompts: list[Any], samples: list[list[Any]]) -> list[Any]:
        from echorl.actor.types import RolloutGroup

        enc = self.policy.encode
        return [RolloutGroup(p.prompt_id, p.text, enc(p.text), s, 0) for p, s in zip(prompts, samples)]

    def proof(self, prompts: list[Any], seed: int, top_p: float = 1.0) -> Any:
        from echorl.learner.spot_check import SeedProof

        return SeedProof(seed, top_p, {p.prompt_id: k for k, p in enumerate(prompts)}, G)

    def sample(self, node: Any, prompts: list[Any], seed: int | None, **change: Any) -> list[list[Any]]:
        texts = [p.text for p in prompts]
        return node.generate(
            texts, G, replace(self.params, **change), seed=self.rng.getrandbits(32), sampling_seed=seed
        )

    def true_logprobs(self, prompts: list[Any], completions: list[list[list[int]]]) -> list[list[Any]]:
        """Samples of the given token ids carrying the policy's log-probs (one prefill each)."""
        import torch

        from echorl.actor.types import Sample

        out = []
        for p, group in zip(prompts, completions):
            ids = self.policy.encode(p.text)
            row = []
            for toks in group:
                with torch.inference_mode():
                    x = torch.tensor([ids + toks], device=self.policy.device)
                    logits = self.policy.model(input_ids=x).logits[0, :-1].float().cpu()
                lp = torch.log_softmax(logits, -1)[len(ids) - 1 :].gather(-1, torch.tensor(toks)[:, None])
                row.append(Sample(list(toks), [min(0.0, x) for x in lp.squeeze(-1).tolist()], "stop", ""))
            out.append(row)
        return out


@contextmanager
def matmul_precision(tf32: bool) -> Iterator[None]:
    """float32 matmuls on CUDA in TF32 (``high``) or in full float32 (``highest``, torch's default)
    for the ``with`` block."""
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _untrained(model: Any, path: Path) -> Any:
    """The untrained model a lazy cheater samples from: the default model's random start, else
    ``model``'s architecture at a random init (same tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM

    from echorl.actor.model import build_default_model, default_model

    if path == default_model():
        return AutoModelForCausalLM.from_pretrained(build_default_model(warmup=None), dtype=torch.float32).eval()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(model.config, dtype=torch.float32).eval()


def _rounded(model: Any, how: str) -> Any:
    """A float32 copy of ``model`` whose weights are rounded to bf16 or to per-row int8."""
    import torch

    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in m.parameters():
            if how == "bf16":
                p.copy_(p.to(torch.bfloat16).float())
            elif p.dim() == 2:
                scale = p.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
                p.copy_((p / scale).round().clamp(-127, 127) * scale)
    return m


def _tokens(samples: list[list[Any]]) -> list[list[list[int]]]:
    return [[list(s.token_ids) for s in g] for g in samples]


def cheat(lab: Lab, name: str, prompts: list[Any], seed: int) -> list[list[Any]]:
    """The samples a node of class ``name`` submits for a lease (prompts, seed)."""
    eos = lab.policy.tokenizer.eos_token_id
    if name == "all_eos":
        return lab.true_logprobs(prompts, [[[eos]] * G for _ in prompts])
    if name == "copied_answers":
        return lab.true_logprobs(prompts, [[lab.policy.encode(p.answer) + [eos]] * G for p in prompts])
    if name == "other_model":
        return lab.true_logprobs(prompts, _tokens(lab.sample(lab.engine("base"), prompts, seed)))
    if name in ("bf16_weights", "int8_weights"):
        node = lab.engine(name)
        return lab.true_logprobs(prompts, _tokens(lab.sample(node, prompts, seed)))
    if name == "temperature_0.7":
        return lab.true_logprobs(prompts, _tokens(lab.sample(lab.policy, prompts, seed, temperature=0.7)))
    if name == "top_p_0.9":
        return lab.true_logprobs(prompts, _tokens(lab.sample(lab.policy, prompts, seed, top_p=0.9)))
    if name == "replayed":
        return lab.sample(lab.policy, prompts, lab.rng.getrandbits(63))  # honest work of another lease
    if name == "unseeded":
        return lab.sample(lab.policy, prompts, None)
    raise ValueError(name)


CLASSES = (
    "all_eos",
    "other_model",
    "temperature_0.7",
    "top_p_0.9",
    "bf16_weights",
    "int8_weights",
    "replayed",
    "copied_answers",
    "unseeded",
)


def honest_tokens(lab: Lab, prompts: list[Any], seed: int) -> list[list[list[int]]]:
    """The tokens an honest float32 node submits for the lease (prompts, seed): the policy's
    seeded samples, same batch (``lab.rng`` is not drawn from, so the leases stay the same)."""
    return _tokens(lab.policy.generate([p.text for p in prompts], G, lab.params, seed=0, sampling_seed=seed))


def run_class(
    lab: Lab, name: str, leases: int, gaps: list[float] | None = None, declare: str = "float32"
) -> dict[str, Any]:
    detected = differing = caught_differing = passed_identical = samples_differing = 0
    differing_gaps: list[float] = []  # each differing submission's largest gap
    for _ in range(leases):
        prompts, seed = lab.lease()
        samples = cheat(lab, name, prompts, seed)
        groups = lab.groups(prompts, samples)
        res = lab.checker.check_sync(groups, 0, "torch", declare, lab.proof(prompts, seed))
        detected += not res.sampled
        mine, honest = _tokens(samples), honest_tokens(lab, prompts, seed)
        differs = mine != honest  # anywhere, in any sample
        differing += differs
        samples_differing += sum(a != b for ga, gb in zip(mine, honest) for a, b in zip(ga, gb))
        caught_differing += differs and not res.sampled
        passed_identical += res.sampled and not differs
        if differs:
            differing_gaps.append(res.max_gap)
        if gaps is not None:
            gaps.extend(lab.checker.replay_gaps(groups, 0, lab.proof(prompts, seed)) or [])
    d = detected / leases
    per_submission = CHECK_FRACTION * d
    passed = leases - detected
    return {
        "cheat": name,
        "declared_dtype": declare,
        "submissions_checked": leases,
        "detected_frac": round(d, 4),
        # against the honest float32 node's submission for the same lease and seed: how many of the
        # cheat's submissions differ from it (any token), how many of those were caught, and how
        # many of the submissions that passed were token for token the honest one
        "submissions_differing": differing,
        "detected_frac_of_differing": round(caught_differing / differing, 4) if differing else None,
        "passed_identical_frac": round(passed_identical / passed, 4) if passed else None,
        # the smallest largest-gap of a differing submission (a strict bound below it would have
        # caught every one) and how many differing submissions had their largest gap under 1e-3
        "samples_per_differing_submission": round(samples_differing / differing, 2) if differing else None,
        "differing_max_gap_min": round(min(differing_gaps), 6) if differing_gaps else None,
        "differing_max_gap_below_1e-3": sum(g <= 1e-3 for g in differing_gaps),
        "flagged_after": round(expected_until_caught(CHECK_FRACTION, d), 1) if d else None,
        "p_caught_within_3": round(p_caught_within(3, CHECK_FRACTION, d), 4),
        "p_caught_within_3_turned": round(1 - (1 - per_submission) ** 3, 4),
        "p_caught_within_3_all_checked": round(1 - (1 - d) ** 3, 6),
    }


def p_caught_within(k: int, f: float, d: float) -> float:
    """A cheat from its first submission: each of a newcomer's first ``NEWCOMER_CHECKS`` is checked
    (caught with probability ``d``), each later one with ``f`` (learner/policing.py)."""
    from echorl.learner.policing import NEWCOMER_CHECKS

    return 1 - (1 - d) ** min(k, NEWCOMER_CHECKS) * (1 - f * d) ** max(0, k - NEWCOMER_CHECKS)


def expected_until_caught(f: float, d: float) -> float:
    """Expected submissions until a cheat from the start is caught: Σ_k P(not caught before k)."""
    from echorl.learner.policing import NEWCOMER_CHECKS

    first = sum((1 - d) ** j for j in range(NEWCOMER_CHECKS))
    return first + (1 - d) ** NEWCOMER_CHECKS / (f * d)


HONEST = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16"}
"""Honest engines and the dtype each declares (a TF32 node computes in float32 as far as it knows)."""


def run_honest(
    lab: Lab, kind: str, leases: int, gaps: list[float], submissions: list[Any] | None = None
) -> dict[str, Any]:
    """An honest node of ``kind`` on ``lab.node_device``: its seeded samples, checked as declared;
    also what the other replay row would have said of the same submissions. ``submissions``
    (if given) gets, per submission, its positions and its gaps above 1e-4 (largest first): the
    raw data for re-deriving a row's bound."""
    from echorl.learner.tolerances import PROOF, PROOF_LOOSE, proof_tolerance

    node, dtype = lab.engine(kind), HONEST[kind]
    flags = logprob_flags = samples = strict_flags = loose_flags = 0
    max_logprob_diff = 0.0
    t0 = time.perf_counter()
    for _ in range(leases):
        prompts, seed = lab.lease()
        with matmul_precision(kind == "tf32"):
            groups = lab.groups(prompts, lab.sample(node, prompts, seed))
        proof = lab.proof(prompts, seed)
        res = lab.checker.check_sync(groups, 0, "torch", dtype, proof)
        flags += not res.sampled
        logprob_flags += not res.ok
        max_logprob_diff = max(max_logprob_diff, res.max_abs_diff)
        samples += sum(len(g.samples) for g in groups)
        mine = lab.checker.replay_gaps(groups, 0, proof) or []
        strict_flags += not PROOF.holds(sum(g > PROOF.gap for g in mine), len(mine))
        loose_flags += not PROOF_LOOSE.holds(sum(g > PROOF_LOOSE.gap for g in mine), len(mine))
        gaps.extend(mine)
        if submissions is not None:
            submissions.append([len(mine), sorted((round(g, 6) for g in mine if g > 1e-4), reverse=True)])
    tol = proof_tolerance("torch", dtype)
    return {
        "honest": kind,
        "declared_dtype": dtype,
        "node_device": lab.node_device,
        "checker_device": str(lab.policy.device),
        "model": lab.path.name,
        "samples_checked": samples,
        "submissions_checked": leases,
        "false_flags": flags,
        "false_flags_strict_row": strict_flags,
        "false_flags_loose_row": loose_flags,
        "logprob_flags": logprob_flags,
        "logprob_max_abs_diff": round(max_logprob_diff, 5),
        "positions": len(gaps),
        "position_miss_rate": round(sum(g > tol.gap for g in gaps) / max(1, len(gaps)), 6),
        "max_gap": round(max(gaps, default=0.0), 6),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def miss_rates(curve: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per engine or class, the fraction of its positions whose gap exceeds each ``CURVE`` bound."""
    return {k: [round(sum(g > t for g in v) / max(1, len(v)), 6) for t in CURVE] for k, v in curve.items()}


def score_rows(path: Path, rows: list[tuple[float, float, int]]) -> list[dict[str, Any]]:
    """Score replay rows (gap, miss fraction, slack) against the honest submissions saved by
    ``scripts/gpu-check.sh --gaps-dir`` (each submission's positions and its gaps above 1e-4):
    one line per engine and row, with the false flags that row would have raised."""
    import json

    from echorl.learner.tolerances import ProofTolerance

    out = []
    for kind, saved in json.loads(path.read_text()).items():
        subs = saved["submissions"]
        for gap, fraction, slack in rows:
            row = ProofTolerance(gap, fraction, slack)
            misses = [sum(g > gap for g in gaps) for _, gaps in subs]
            flags = sum(not row.holds(m, positions) for m, (positions, _) in zip(misses, subs))
            out.append(
                {"data": path.name, "honest": kind, "row": [gap, fraction, slack], "submissions": len(subs),
                 "false_flags": flags, "max_misses": max(misses, default=0)}
            )  # fmt: skip
    return out


def costs(lab: Lab, leases: int) -> dict[str, Any]:
    """Generation CPU with and without seeded sampling (alternating, same prompts), and the
    replay's CPU per submission."""
    gen = {"seeded": 0.0, "plain": 0.0}
    verify = 0.0
    for i in range(leases):
        prompts, seed = lab.lease()
        order = ("seeded", "plain") if i % 2 else ("plain", "seeded")
        for how in order:
            t0 = time.process_time()
            out = lab.sample(lab.policy, prompts, seed if how == "seeded" else None)
            gen[how] += time.process_time() - t0
            if how == "seeded":
                groups = lab.groups(prompts, out)
        t0 = time.process_time()
        lab.checker.check_sync(groups, 0, "torch", "float32", lab.proof(prompts, seed))
        verify += time.process_time() - t0
    return {
        "verify_cpu_frac": round(CHECK_FRACTION * verify / gen["seeded"], 4),
        "verify_cpu_per_submission_vs_generation": round(verify / gen["seeded"], 4),
        "throughput_ratio": round(gen["plain"] / gen["seeded"], 4),
        "check_fraction": CHECK_FRACTION,
        "leases": leases,
    }


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--prompts", type=int, default=8, help="prompts per lease (G=8 samples each)")
    p.add_argument("--cheat-leases", type=int, default=100)
    p.add_argument("--honest-samples", type=int, default=10_000)
    p.add_argument("--cost-leases", type=int, default=30)
    p.add_argument("--calibrate", action="store_true", help="also print the per-position gap curve")
    p.add_argument("--only", default="", help="comma-separated classes (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--declare", default="float32", help="the dtype cheaters declare (bfloat16: the loose row)")
    p.add_argument("--honest", default="fp32,bf16", help="honest engines to run (comma-separated, or none)")
    p.add_argument("--no-costs", action="store_true")
    p.add_argument("--model", default=None, help="an HF model directory (default: the shipped default model)")
    p.add_argument("--task", default="addition", help="the task (with --model: in its chat template)")
    p.add_argument("--checker-device", default="cpu", help="where the learner's float32 replay runs")
    p.add_argument("--node-device", default="cpu", help="where the honest engines run (cuda: GPU nodes)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--score", default="", help="a gaps JSON of gpu-check --gaps-dir: score --rows on it, run nothing")
    p.add_argument("--rows", default="0.1,0.005,2;0.3,0.003,3", help="gap,fraction,slack;... for --score")
    args = p.parse_args()
    if args.score:
        rows = [(float(g), float(f), int(k)) for g, f, k in (r.split(",") for r in args.rows.split(";"))]
        for line in score_rows(Path(args.score), rows):
            emit(line, args.json)
        return
    torch.set_num_threads(args.threads)
    lab = Lab(args.prompts, args.seed, args.model, args.task, args.checker_device, args.node_device)
    honest_leases = -(-args.honest_samples // (args.prompts * G))
    curve: dict[str, list[float]] = {}
    for kind in [k for k in args.honest.split(",") if k in HONEST]:
        curve[kind] = []
        emit(run_honest(lab, kind, honest_leases, curve[kind]), args.json)
    for name in [c for c in CLASSES if not args.only or c in args.only.split(",")]:
        gaps: list[float] | None = [] if args.calibrate else None
        emit(run_class(lab, name, args.cheat_leases, gaps, args.declare), args.json)
        if gaps is not None:
            curve[name] = gaps
    if not args.no_costs:
        emit(costs(lab, args.cost_leases), args.json)
    if args.calibrate:
        emit({"curve_gap": list(CURVE), "position_miss_rate": miss_rates(curve)}, args.json)


if __name__ == "__main__":
    main()
