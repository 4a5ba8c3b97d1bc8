"""LoRA over the network on the tiny default model: a learner trains an adapter, each version is
the adapter (signed, chunked, broadcast) naming its base by digest, two nodes apply it to their
own base and their rollouts are accepted (spot checks recompute them on base + adapter), a node
whose base differs is told so in one line and exits 2, and the checkpoint exports to a model
directory transformers loads."""

from __future__ import annotations

import torch

from echorl.actor import lora
from echorl.actor.model import build_default_model, default_model
from echorl.cli.main import main


def test_two_lora_steps_over_the_network(swarm, tmp_path):
    other = build_default_model(tmp_path / "other-base", seed=1, warmup=None)  # same shapes, other weights
    ck = tmp_path / "ck"
    swarm.start_learner(
        *("--steps", "2", "--staleness", "1", "--lora-rank", "4", "--prompts-per-step", "4"),
        *("--prompts-per-lease", "2", "--eval-every", "2", "--task-option", "n_eval=16", "--spot-check-fraction", "1"),
        *("--checkpoint-dir", str(ck)),
    )
    nodes = [swarm.start_node("a"), swarm.start_node("b")]
    stranger = swarm.start_node("c", "--model", str(other))
    assert stranger.wait(timeout=120) == 2
    line = (tmp_path / "c.log").read_text().strip().splitlines()[-1]
    assert line.startswith("echorl node: this run trains a LoRA adapter over base model")
    swarm.wait_for(lambda: swarm.learner.poll() is not None, timeout=240, what="learner to finish")
    assert swarm.learner.returncode == 0
    rows = [r for r in swarm.metrics() if r["step"] > 0]
    last = rows[-1]
    assert last["step"] == 2 and last["rollouts_accepted"] >= 8
    assert last["spot_checks"] > 0 and last["rollouts_rejected_logprob"] == 0  # base + adapter recomputed
    full_bytes = (default_model() / "model.safetensors").stat().st_size
    adapter = [r for r in rows if r.get("broadcast_version") is not None]
    assert adapter and all(r["broadcast_result_bytes"] < full_bytes / 5 for r in adapter)
    for n in nodes:  # both received adapter versions and are told the run is over
        assert n.wait(timeout=60) == 0
    logs = [(tmp_path / f"{name}.log").read_text() for name in ("a", "b")]
    assert all("final version 2" in log for log in logs)

    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(ck), "--out", str(out)]) == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(default_model())
    assert any(not torch.equal(a, b) for a, b in zip(merged.state_dict().values(), base.state_dict().values()))
    assert lora.base_digest(out) != lora.base_digest(default_model())
