"""Spot-check tolerance per (engine, dtype) (learner/tolerances.py): the table's lookup rules, that the
checker applies the row of the node's declaration (a bf16-sized disagreement passes a bf16 node
and fails a float32 one; another version's log-probs fail every row), and that the capability
record carries the dtype without changing the bytes of a record that does not."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from echorl.learner.tolerances import TABLE, Tolerance, tolerance_for

BASE = Tolerance(0.02, 0.5)


def test_lookup_rules():
    assert tolerance_for("torch", "float32", BASE) == BASE
    assert tolerance_for("torch", None, BASE) == BASE  # an old node that declares nothing: float32
    assert tolerance_for("torch", "bfloat16", BASE) == TABLE[("torch", "bfloat16")]
    assert tolerance_for("vllm", "float32", BASE) == TABLE[("vllm", "float32")]
    assert tolerance_for("torch", "float8_e4m3", BASE) == BASE  # unknown dtype earns nothing looser
    assert tolerance_for("sglang", "bfloat16", BASE) == TABLE[("torch", "bfloat16")]  # unknown engine: torch
    assert tolerance_for("torch", "float32", BASE, checker_dtype="bfloat16") == TABLE[("torch", "bfloat16")]
    wide = Tolerance(1.0, 10.0)
    assert tolerance_for("vllm", "bfloat16", wide) == wide  # configured values are a floor
    assert all(t.mean > BASE.mean and t.max > BASE.max for t in TABLE.values())


@pytest.fixture(scope="module")
def checked():
    """(checker over snapshots {0, 1}, groups sampled at version 0 by the tiny untrained model)."""
    import torch

    from echorl.actor.backend import TorchBackend
    from echorl.actor.model import build_default_model
    from echorl.actor.types import RolloutGroup, SamplingParams
    from echorl.learner.spot_check import SpotChecker
    from echorl.protocol import snapshot

    torch.manual_seed(0)
    backend = TorchBackend.from_pretrained(build_default_model(warmup=None))
    texts = ["12+34=", "5+6=", "70+8="]
    samples = backend.generate(texts, 4, SamplingParams(temperature=1.0, max_new_tokens=6), seed=1)
    groups = [RolloutGroup(f"p{i}", t, backend.encode(t), s, 0) for i, (t, s) in enumerate(zip(texts, samples))]
    other = {k: v + 0.5 * torch.randn_like(v) for k, v in backend.model.state_dict().items()}
    snaps = {
        0: snapshot.state_dict_to_safetensors(backend.model.state_dict()),
        1: snapshot.state_dict_to_safetensors(other),
    }
    return SpotChecker(backend.model, backend.tokenizer, 1.0, 1.0, snaps.get), groups


def _shifted(groups, by: float):
    import copy

    out = copy.deepcopy(groups)
    for g in out:
        for s in g.samples:
            s.logprobs = [min(0.0, lp - by) for lp in s.logprobs]
    return out


def test_checker_applies_the_declared_row(checked):
    checker, groups = checked
    assert checker.check_sync(groups, 0).ok  # honest float32
    drift = _shifted(groups, 0.06)  # bf16-sized: beyond the float32 mean bound, inside the bf16 row
    assert not checker.check_sync(drift, 0, "torch", "float32").ok
    assert not checker.check_sync(drift, 0, "torch", None).ok
    assert checker.check_sync(drift, 0, "torch", "bfloat16").ok
    assert checker.check_sync(drift, 0, "vllm", "bfloat16").ok
    assert not checker.check_sync(drift, 0, "torch", "float8").ok
    for engine, dtype in TABLE:  # the loosest row still refuses another version's log-probs
        assert not checker.check_sync(groups, 1, engine, dtype).ok


def test_capability_dtype_is_optional_on_the_wire():
    from echorl.protocol import wire
    from echorl.protocol.messages import Capability, JoinRequest

    base = dict(
        engine="vllm",
        device="cuda:0",
        memory_bytes=1,
        tokens_per_s=1.0,
        price_per_hour=0.0,
        reachable=True,
        listen_addrs=[],
    )
    join = dict(run_id="r", peer_id="1" * 40, version=-1, timestamp=1.0, nonce=b"\0" * 16)
    old = JoinRequest(capability=Capability(**base), **join)
    new = JoinRequest(capability=Capability(**base, dtype="bfloat16"), **join)
    assert b"dtype" not in wire.encode(old)  # byte for byte what a node predating the field sends
    assert wire.decode(wire.encode(new), JoinRequest).capability.dtype == "bfloat16"
    assert wire.decode(wire.encode(old), JoinRequest).capability.dtype is None
    with pytest.raises(ValueError):
        Capability(**base, dtype="x" * 300)
