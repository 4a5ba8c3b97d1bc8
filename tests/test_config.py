"""The typed configs and the command line built from them (``echorl/config.py``): flags come
from the fields (aliases, bools, KEY=VALUE), a config file is read, flags override it, the TOML
written by ``--print-config`` reads back to the same config, bad values are one clear error, and
``LeasePolicy`` is the learner config's lease section."""

from __future__ import annotations

import argparse
import math
import tomllib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from echorl import config
from echorl.learner.config import LearnerConfig, TrainLocalConfig
from echorl.node.config import NodeConfig


def _parse(cls: type, argv: list[str]) -> config.Section:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser, cls)
    return config.load(cls, parser.parse_args(argv), "test")


def test_old_flag_names_reach_their_fields() -> None:
    cfg = _parse(LearnerConfig, ["--lease-timeout", "5", "--no-dht", "--task-option", "digits=3",
                                 "--task-option", "path=x.jsonl", "--resume", "--activation", "cost"])
    assert cfg.lease_timeout_s == 5.0 and cfg.dht is False and cfg.resume is True and cfg.activation == "cost"
    assert cfg.task_options == {"digits": 3, "path": "x.jsonl"}  # typed like parse_task_options
    assert _parse(LearnerConfig, []).dht is True


def test_defaults_differ_per_role_but_bounds_are_shared() -> None:
    assert (TrainLocalConfig().steps, TrainLocalConfig().staleness, LearnerConfig().staleness) == (400, 0, 4)
    for cls in (LearnerConfig, TrainLocalConfig):
        with pytest.raises(config.ConfigError, match=r"--staleness \(staleness\): Input should be greater"):
            _parse(cls, ["--staleness", "-1"])
    assert TrainLocalConfig.model_fields["staleness"].description == LearnerConfig.model_fields["staleness"].description


@pytest.mark.parametrize("cls, argv", [
    (LearnerConfig, ["--steps", "3", "--task-option", "digits=2", "--model", "m", "--no-dht", "--lr", "0.001"]),
    (NodeConfig, ["--bootstrap", "/ip4/1.2.3.4/tcp/5/p2p/x", "--engine", "vllm", "--price-per-hour", "0.25"]),
    (TrainLocalConfig, ["--quiet", "--loss-norm", "sequence", "--max-inflight", "9"]),
])
def test_printed_toml_reads_back_and_flags_override_it(tmp_path, cls, argv) -> None:
    cfg = _parse(cls, argv)
    path = tmp_path / "c.toml"
    path.write_text(config.to_toml(cfg))
    assert _parse(cls, ["--config", str(path)]) == cfg
    again = _parse(cls, ["--config", str(path), "--seed", "7"])
    assert again.seed == 7 and again.model_dump(exclude={"seed"}) == cfg.model_dump(exclude={"seed"})


def test_unknown_file_key_and_missing_required_field(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('stepz = 3\n')
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


def test_lease_policy_is_the_lease_section_of_the_learner_config() -> None:
    from echorl.learner.config import LeaseFields
    from echorl.learner.service import LeasePolicy
    from echorl.protocol.messages import SamplingSpec

    cfg = LearnerConfig(staleness=2, group_size=4, prompts_per_step=3, prompts_per_lease=5, lease_timeout_s=7.0,
                        liveness_after_s=1.5, ping_timeout_s=2.5, heartbeat_s=0.5, activation="cost",
                        activation_margin=0.5, activation_interval_s=3.0, activation_loss_window_s=60.0,
                        activation_hysteresis=0.1, max_peers_per_ip=3, plan_newcomers=2, plan_max_members=9,
                        idle_member_drop_s=5.0, dead_member_drop_s=4.0)
    spec = SamplingSpec(temperature=0.7, top_p=1.0, max_new_tokens=9, stop=[])
    policy = LeasePolicy.of(cfg, spec)
    assert policy.sampling == spec
    for name in LeaseFields.model_fields:
        assert getattr(policy, name) == getattr(cfg, name) != getattr(LeasePolicy(), name), name


scalars = st.one_of(st.text(max_size=20), st.integers(-2**62, 2**62), st.booleans(),
                    st.floats(allow_nan=True, allow_infinity=True))


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
