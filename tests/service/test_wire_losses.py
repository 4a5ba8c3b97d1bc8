"""The service's pure parts: request decoding bounds (JSON and protobuf), result encodings, the
built-in losses' values and gradients, API keys, the future book."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from echorl.service import losses, proto, wire
from echorl.service.futures import FutureBook
from echorl.service.sessions import KeyFileError, check_key, load_keys

LIMITS = wire.Limits(max_tokens_per_request=64, max_data=4)


def _tensor(values, dtype):
    return {"data": list(values), "dtype": dtype, "shape": [len(values)]}


def _json_datum(tokens, targets, **extra):
    inputs = {"target_tokens": _tensor(targets, "int64"), **{k: _tensor(v, "float32") for k, v in extra.items()}}
    return {"model_input": {"chunks": [{"type": "encoded_text", "tokens": tokens}]}, "loss_fn_inputs": inputs}


def _json_req(data, loss="cross_entropy"):
    return {"model_id": "m", "forward_backward_input": {"data": data, "loss_fn": loss}}


def test_json_and_protobuf_decode_to_the_same_request():
    body = _json_req([_json_datum([3, 4, 5], [4, 5, 6], weights=[0, 1, 1])])
    from_json = wire.fwdbwd_from_json(body, LIMITS, forward_only=False)
    msg = proto.message("ForwardBackwardRequest")
    msg.model_id, msg.loss_fn, msg.seq_id = "m", "cross_entropy", 1
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.array([3, 4, 5], dtype=np.int32).tobytes()
    target = datum.loss_fn_inputs["target_tokens"]
    target.dense, target.dtype = np.array([4, 5, 6], dtype=np.int64).tobytes(), proto.DTYPE_INT64
    target.shape.append(3)
    weights = datum.loss_fn_inputs["weights"]  # sparse CSR of a [1, 3] row, as the client sends 2-D weights
    weights.sparse_csr.values = np.array([1, 1], dtype=np.float32).tobytes()
    weights.sparse_csr.crow_indices = np.array([0, 2], dtype=np.int64).tobytes()
    weights.sparse_csr.col_indices = np.array([1, 2], dtype=np.int64).tobytes()
    weights.dtype = proto.DTYPE_FLOAT32
    weights.shape.extend([1, 3])
    with pytest.raises(wire.WireError, match="one value per input token"):
        wire.fwdbwd_from_proto(msg.SerializeToString(), LIMITS)
    weights.shape[:] = [3]
    weights.sparse_csr.Clear()
    weights.dense = np.array([0, 1, 1], dtype=np.float32).tobytes()
    from_proto = wire.fwdbwd_from_proto(msg.SerializeToString(), LIMITS)
    assert from_proto.data[0].tokens == from_json.data[0].tokens == [3, 4, 5]
    for name in ("target_tokens", "weights"):
        np.testing.assert_array_equal(from_proto.data[0].inputs[name], from_json.data[0].inputs[name])


@pytest.mark.parametrize(
    "body, needle",
    [
        (_json_req([_json_datum(list(range(70)), list(range(70)))]), "token limit"),
        (_json_req([_json_datum([1], [2])] * 5), "at most 4"),
        (
            _json_req([{"model_input": {"chunks": [{"type": "image", "data": "x"}]}, "loss_fn_inputs": {}}]),
            "token chunks",
        ),
        (_json_req([_json_datum([1, 2], [2, 3])], loss="custom"), "not served"),
        (
            _json_req([{"model_input": {"chunks": []}, "loss_fn_inputs": {"target_tokens": _tensor([], "int64")}}]),
            "empty",
        ),
    ],
)
def test_bad_requests_are_one_line(body, needle):
    with pytest.raises(wire.WireError, match=needle):
        wire.fwdbwd_from_json(body, LIMITS, forward_only=False)


def test_malformed_protobuf_is_refused():
    with pytest.raises(wire.WireError, match="protobuf"):
        wire.fwdbwd_from_proto(b"\xff\xff\xff", LIMITS)


def test_result_format_follows_accept():
    assert wire.wants_proto("application/x-protobuf")  # tinker 0.38
    assert not wire.wants_proto("application/x-protobuf, application/json")  # tinker 0.21
    assert not wire.wants_proto("")
    result = wire.FwdBwdResult(
        outputs=[{"logprobs": np.array([-1.0, -2.0])}, {"logprobs": np.array([-3.0])}], metrics={}
    )
    msg = proto.message("ForwardBackwardOutput")
    msg.ParseFromString(wire.fwdbwd_proto(result))
    field = msg.loss_fn_outputs[0].fields["logprobs"]
    assert np.frombuffer(field.offsets, dtype=np.int64).tolist() == [0, 8, 12]
    assert np.frombuffer(field.data, dtype=np.float32).tolist() == [-1.0, -2.0, -3.0]


def test_losses():
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ce = losses.elementwise("cross_entropy", logp, {"weights": np.array([0, 1, 1], dtype=np.float32)}, {})
    assert ce.sum().item() == pytest.approx(2.5)
    inputs = {
        "logprobs": np.array([-1.0, -1.0, -1.0], dtype=np.float32),
        "advantages": np.array([1, 1, -1], dtype=np.float32),
    }
    is_loss = losses.elementwise("importance_sampling", logp, inputs, {})
    ratio = torch.exp(logp.detach() + 1.0)
    assert is_loss.detach().tolist() == pytest.approx((-ratio * torch.tensor([1.0, 1.0, -1.0])).tolist())
    ppo = losses.elementwise("ppo", logp, inputs, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    ppo.sum().backward()
    # token 0: r = 1 (inside the clip), token 1: r = e^-1 with A > 0 (unclipped branch is the min),
    # token 2: r = e^0.5 > 1.1 with A < 0: min picks r*A, so the gradient flows
    assert logp.grad.tolist() == pytest.approx([-1.0, -np.exp(-1.0), np.exp(0.5)], rel=1e-5)
    with pytest.raises(losses.LossInputError, match="advantages"):
        losses.check_inputs("ppo", {"target_tokens": np.array([1])}, 0)


def test_api_keys(tmp_path):
    key = "tml-" + "a" * 32
    path = tmp_path / "keys"
    path.write_text(f"# comment\n{key} alice\n")
    keys = load_keys(path)
    assert check_key(keys, key) == "alice"
    assert check_key(keys, key + "x") is None and check_key(keys, None) is None
    path.write_text("sk-" + "a" * 32 + "\n")
    with pytest.raises(KeyFileError, match="tml-"):
        load_keys(path)


def test_future_book_long_poll_and_owner():
    async def main():
        book = FutureBook(max_futures=4, keep_s=60, poll_wait_s=0.2)
        fut = book.create("alice", "json")
        assert book.get("bob", fut.ident) is None
        assert await book.wait(fut) is False  # nothing yet: try again
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: book.wait(fut))
            FutureBook.finish(fut, result={"ok": 1})
        assert await book.wait(fut) is True and book.get("alice", fut.ident).result == {"ok": 1}
        for _ in range(4):
            book.create("alice", "json")
        assert book.get("alice", fut.ident) is None  # full: the finished one made room
        with pytest.raises(OverflowError):
            book.create("alice", "json")  # all four pending: none can be dropped

    trio.run(main)


def test_prompt_logprobs_are_each_next_tokens_under_the_base_model():
    """``sample(..., prompt_logprobs=True)``: the first position has none, then each prompt
    token's log-prob given the tokens before it, computed on the model's device."""
    import torch

    from echorl.actor.model import default_model
    from echorl.actor.types import SamplingParams
    from echorl.service.engine import Engine, Snapshot

    engine = Engine(default_model())
    prompt = engine.sampler.encode("12+34=")
    out = engine.sample(Snapshot(None, None), prompt, 2, SamplingParams(max_new_tokens=3), 0, [], True)
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits.float()
    want = torch.log_softmax(logits[0, :-1], -1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1:] == pytest.approx(want.tolist(), abs=1e-5)
    assert len(out.sequences) == 2
