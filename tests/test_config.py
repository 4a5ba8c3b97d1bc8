"""The typed configs and the command line built from them (``echorl/config.py``): flags come
from the fields (aliases, bools, KEY=VALUE), a config file is read, flags override it, the TOML
written by ``--print-config`` reads back to the same config, bad values are one clear error, and
every tunable of the learner's service is a flag that reaches the component reading it."""

from __future__ import annotations

import argparse
import math
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echorl.common import config
from echorl.learner.config import LearnerConfig
from echorl.node.config import NodeConfig
from echorl.rl.config import TrainLocalConfig


def _parse(cls: type, argv: list[str]) -> config.Section:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, cls)
    return config.load(cls, parser.parse_args(argv), "test")


def test_old_flag_names_reach_their_fields() -> None:
    cfg = _parse(
        LearnerConfig,
        [
            "--lease-timeout",
            "5",
            "--no-dht",
            "--task-option",
            "digits=3",
            "--task-option",
            "path=x.jsonl",
            "--resume",
            "--activation",
            "cost",
        ],
    )
    assert cfg.lease_timeout_s == 5.0 and cfg.dht is False and cfg.resume is True and cfg.activation == "cost"
    assert cfg.task_options == {"digits": 3, "path": "x.jsonl"}  # typed like parse_task_options
    assert _parse(LearnerConfig, []).dht is True


def test_defaults_differ_per_role_but_bounds_are_shared() -> None:
    assert (TrainLocalConfig().steps, TrainLocalConfig().staleness, LearnerConfig().staleness) == (400, 0, 4)
    for cls in (LearnerConfig, TrainLocalConfig):
        with pytest.raises(config.ConfigError, match=r"--staleness \(staleness\): Input should be greater"):
            _parse(cls, ["--staleness", "-1"])
    assert TrainLocalConfig.model_fields["staleness"].description == LearnerConfig.model_fields["staleness"].description


@pytest.mark.parametrize(
    "cls, argv",
    [
        (LearnerConfig, ["--steps", "3", "--task-option", "digits=2", "--model", "m", "--no-dht", "--lr", "0.001"]),
        (NodeConfig, ["--bootstrap", "/ip4/1.2.3.4/tcp/5/p2p/x", "--engine", "vllm", "--price-per-hour", "0.25"]),
        (TrainLocalConfig, ["--quiet", "--loss-norm", "sequence", "--max-inflight", "9"]),
    ],
)
def test_printed_toml_reads_back_and_flags_override_it(tmp_path, cls, argv) -> None:
    cfg = _parse(cls, argv)
    path = tmp_path / "c.toml"
    path.write_text(config.to_toml(cfg))
    assert _parse(cls, ["--config", str(path)]) == cfg
    again = _parse(cls, ["--config", str(path), "--seed", "7"])
    assert again.seed == 7 and again.model_dump(exclude={"seed"}) == cfg.model_dump(exclude={"seed"})


def test_unknown_file_key_and_missing_required_field(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("stepz = 3\n")
    with pytest.raises(config.ConfigError, match=r"unknown test config keys: \['stepz'\]"):
        _parse(LearnerConfig, ["--config", str(path)])
    with pytest.raises(config.ConfigError, match="--bootstrap \\(bootstrap\\) is required"):
        _parse(NodeConfig, [])
    path.write_text('bootstrap = "/ip4/1.2.3.4/tcp/5/p2p/x"\nmax_prompts = 100000\n')
    with pytest.raises(config.ConfigError, match="--max-prompts"):
        _parse(NodeConfig, ["--config", str(path)])


def test_bad_key_value_item_is_a_config_error() -> None:
    with pytest.raises(config.ConfigError, match="must look like key=value"):
        _parse(LearnerConfig, ["--task-option", "digits"])


def test_every_service_tunable_is_a_flag_that_reaches_its_component() -> None:
    """The service's components read the one learner config (typed as their section), so a flag
    given for any ``ServiceFields`` field is what the component sees; the six admission tunables
    were reachable by no flag before."""
    from echorl.learner.config import ServiceFields
    from echorl.learner.service import LearnerService
    from echorl.protocol.identity import Identity
    from echorl.rl.buffer import StalenessBuffer
    from echorl.tasks import load_task

    changed = {
        "max_leases_per_peer": 3,
        "unmeasured_deadline_factor": 2.5,
        "expiry_backoff_s": 1.5,
        "expiry_backoff_max_s": 60.0,
        "refuse_after_expiries": 4,
        "apply_bytes_per_s": 5e7,
        "max_peers_per_ip": 3,
        "plan_newcomers": 2,
        "activation": "cost",
        "activation_hysteresis": 0.1,
        "spot_check_ban_after": 5,
        "price_per_hour": 1.5,
        "staleness": 2,
        "prompts_per_step": 3,
    }
    argv: list[str] = []
    for name, value in changed.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    cfg = _parse(LearnerConfig, argv)
    assert set(ServiceFields.model_fields) <= set(LearnerConfig.model_fields)
    for name, value in changed.items():
        assert getattr(cfg, name) == value != getattr(ServiceFields(), name), name
    svc = LearnerService(
        Identity.generate(), "run-1", load_task("addition"), None, StalenessBuffer(2), cfg, vocab_size=100
    )
    assert svc.admission.policy.max_leases_per_peer == 3 and svc.admission.policy.apply_bytes_per_s == 5e7
    assert svc.roster.policy.max_peers_per_ip == 3 and svc.activator.policy.activation == "cost"
    assert svc.police.ban_after == 5 and svc.ledger.price_per_hour == 1.5
    assert svc.rule.in_flight_cap == 3 and svc.rule.bound == 2


scalars = st.one_of(
    st.text(max_size=20), st.integers(-(2**62), 2**62), st.booleans(), st.floats(allow_nan=True, allow_infinity=True)
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=10), scalars, max_size=5), st.text(max_size=30))
def test_toml_writer_round_trips_any_scalar(options, model) -> None:
    cfg = LearnerConfig.model_construct(**{**LearnerConfig().model_dump(), "task_options": options, "model": model})
    back = tomllib.loads(config.to_toml(cfg))
    assert back["model"] == model
    assert set(back["task_options"]) == set(options)
    for k, v in options.items():
        got = back["task_options"][k]
        assert (math.isnan(got) and math.isnan(v)) if isinstance(v, float) and math.isnan(v) else got == v


def test_every_role_computes_float32_at_full_precision_never_tf32() -> None:
    """A TF32 node misses the replay's strict row (measured on an H200, learner/tolerances.py):
    pinning a role's device also pins float32 matmuls to full precision, whatever was set."""
    import torch

    from echorl.actor.device import pin_device
    from echorl.node.config import NodeConfig

    cfg = _parse(NodeConfig, ["--bootstrap", "x", "--device", "cpu"])
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # what a user's script or library may have set
    try:
        assert pin_device(cfg) == "cpu, float32"
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_device_resolution_is_honest(monkeypatch) -> None:
    import torch

    from echorl.actor.device import DeviceError, resolve_device

    assert resolve_device("cpu") == ("cpu", "float32")
    assert resolve_device("cpu", "bfloat16") == ("cpu", "bfloat16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == ("cpu", "float32")
    for asked in ("cuda", "cuda:1"):
        with pytest.raises(DeviceError, match="CUDA is not available"):
            resolve_device(asked)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == ("cuda:0", "bfloat16")  # bf16 on GPU by default
    assert resolve_device("cuda", "float32") == ("cuda:0", "float32")
    with pytest.raises(DeviceError, match="1 CUDA device"):
        resolve_device("cuda:1")
    with pytest.raises(config.ConfigError, match="device"):
        _parse(NodeConfig, ["--bootstrap", "x", "--device", "tpu"])
