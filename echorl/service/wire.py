"""What the Tinker clients send and get back, as echorl's own plain types.

Requests arrive as JSON (every endpoint; tinker 0.21 also for ``forward``/``forward_backward``) or,
for ``forward_backward`` from tinker 0.38, as protobuf (:mod:`echorl.service.proto`). Both decode to
:class:`FwdBwdRequest`; every list and tensor is bounded and checked here, where it enters.
Results (:class:`FwdBwdResult`, :class:`SampleResult`) are encoded in the format the client asked
for: JSON unless its ``Accept`` names protobuf and not JSON (tinker 0.38 reads only protobuf for
these two; 0.21 sends ``application/x-protobuf, application/json`` and gets JSON).

Sources: ``tinker/types/*.py``, ``tinker/proto/request_conv.py`` and ``response_conv.py`` of
tinker 0.38.0, ``tinker/lib/_pydantic_conv.py`` and ``tinker/types/_pydantic_types`` of 0.21.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import proto

PROTO = "application/x-protobuf"
JSON = "application/json"
LOSSES = ("cross_entropy", "importance_sampling", "ppo")
MAX_CONFIG_KEYS = 16
"""Loss configs are a handful of floats (PPO's two clip thresholds); more is not a real request."""


class WireError(ValueError):
    """A request the server refuses as malformed or out of bounds: one line back to the client."""


@dataclass(frozen=True)
class Limits:
    """Bounds applied where a request enters."""

    max_tokens_per_request: int
    """tokens over all data of one forward/forward_backward request (and one prompt)"""
    max_data: int
    """data items of one request"""


@dataclass
class Datum:
    """One training example: the model's input tokens and its per-position loss inputs (dense)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class FwdBwdRequest:
    model_id: str
    data: list[Datum]
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    seq_id: int | None = None


@dataclass
class FwdBwdResult:
    """Per datum, named float32 arrays (``logprobs``, ``elementwise_loss``); metrics ``name:reduction``."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


@dataclass
class SampleResult:
    sequences: list[Sequence]
    prompt_logprobs: list[float | None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- decoding


def _tokens_from_chunks(chunks: Any) -> list[int]:
    if not isinstance(chunks, list):
        raise WireError("model_input.chunks must be a list")
    tokens: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise WireError(f"echorl serve takes token chunks (encoded_text) only, got {kind!r}")
        values = chunk.get("tokens")
        if not isinstance(values, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
            raise WireError("encoded_text.tokens must be a list of integers")
        tokens.extend(values)
    return tokens


def model_input_tokens(model_input: Any) -> list[int]:
    """The token ids of a JSON ``ModelInput`` (``{"chunks": [{"type": "encoded_text", "tokens": […]}]}``)."""
    if not isinstance(model_input, dict):
        raise WireError("model_input must be an object with chunks")
    return _tokens_from_chunks(model_input.get("chunks"))


def _dense(values: np.ndarray, shape: list[int] | None, crow: Any, col: Any) -> np.ndarray:
    if crow is None:
        return values.reshape(shape) if shape else values
    if shape is None or len(shape) != 2:
        raise WireError("a sparse tensor needs a 2-D shape")
    crow_a, col_a = np.asarray(crow, dtype=np.int64), np.asarray(col, dtype=np.int64)
    rows, cols = shape
    if (
        len(crow_a) != rows + 1
        or len(col_a) != len(values)
        or (len(col_a) and (col_a.min() < 0 or col_a.max() >= cols))
    ):
        raise WireError("sparse tensor indices do not match its shape")
    dense = np.zeros((rows, cols), dtype=values.dtype)
    for r in range(rows):
        lo, hi = int(crow_a[r]), int(crow_a[r + 1])
        if not 0 <= lo <= hi <= len(values):
            raise WireError("sparse tensor row pointers out of range")
        dense[r, col_a[lo:hi]] = values[lo:hi]
    return dense


def _tensor_from_json(obj: Any, name: str, limit: int) -> np.ndarray:
    if not isinstance(obj, dict) or not isinstance(obj.get("data"), list):
        raise WireError(f"loss_fn_inputs[{name!r}] must be a TensorData object")
    dtype = {"int64": np.int64, "float32": np.float32}.get(obj.get("dtype"))
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}].dtype must be int64 or float32")
    shape = obj.get("shape")
    if shape is not None and (not isinstance(shape, list) or any(not isinstance(s, int) or s < 0 for s in shape)):
        raise WireError(f"loss_fn_inputs[{name!r}].shape must be a list of sizes")
    if len(obj["data"]) > limit or (shape and int(np.prod(shape)) > limit):
        raise WireError(f"loss_fn_inputs[{name!r}] is larger than the request's token limit")
    try:
        values = np.asarray(obj["data"], dtype=dtype)
        return _dense(values, shape, obj.get("sparse_crow_indices"), obj.get("sparse_col_indices"))
    except (TypeError, ValueError) as exc:
        raise WireError(f"loss_fn_inputs[{name!r}]: {exc}") from None


_PROTO_DTYPES = {proto.DTYPE_FLOAT32: np.float32, proto.DTYPE_INT64: np.int64, proto.DTYPE_INT32: np.int32}


def _tensor_from_proto(msg: Any, name: str, limit: int) -> np.ndarray:
    dtype = _PROTO_DTYPES.get(msg.dtype)
    if dtype is None:
        raise WireError(f"loss_fn_inputs[{name!r}]: unsupported dtype {msg.dtype}")
    shape = list(msg.shape) or None
    sparse = msg.WhichOneof("encoding") == "sparse_csr"
    raw = msg.sparse_csr.values if sparse else msg.dense
    if len(raw) % np.dtype(dtype).itemsize or len(raw) // np.dtype(dtype).itemsize > limit:
        raise WireError(f"loss_fn_inputs[{name!r}] has a bad length or exceeds the token limit")
    if shape and int(np.prod(shape)) > limit:
        raise WireError(f"loss_fn_inputs[{name!r}] is larger than the request's token limit")
    values = np.frombuffer(raw, dtype=dtype).astype(np.int64 if dtype != np.float32 else np.float32)
    if not sparse:
        if shape and int(np.prod(shape)) != values.size:
            raise WireError(f"loss_fn_inputs[{name!r}]: shape does not match the data")
        return values.reshape(shape) if shape else values
    crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
    col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
    return _dense(values, shape, crow, col)


def _check_datum(tokens: list[int], inputs: dict[str, np.ndarray], index: int) -> Datum:
    if not tokens:
        raise WireError(f"datum {index}: empty model_input")
    for name, arr in inputs.items():
        if arr.ndim != 1 or arr.shape[0] != len(tokens):
            raise WireError(
                f"datum {index}: loss_fn_inputs[{name!r}] has shape {list(arr.shape)}, "
                f"echorl serve needs [{len(tokens)}] (one value per input token)"
            )
    if "target_tokens" not in inputs:
        raise WireError(f"datum {index}: loss_fn_inputs needs target_tokens")
    return Datum(tokens=tokens, inputs=inputs)


def _check_request(req: FwdBwdRequest, limits: Limits) -> FwdBwdRequest:
    if req.loss_fn not in LOSSES:
        raise WireError(f"loss_fn {req.loss_fn!r} is not served by echorl (built-in losses: {', '.join(LOSSES)})")
    if not req.data:
        raise WireError("no data")
    if len(req.data) > limits.max_data:
        raise WireError(f"{len(req.data)} data items, the server takes at most {limits.max_data} per request")
    if sum(len(d.tokens) for d in req.data) > limits.max_tokens_per_request:
        raise WireError(f"more than {limits.max_tokens_per_request} tokens in one request")
    if len(req.config) > MAX_CONFIG_KEYS or not all(np.isfinite(v) for v in req.config.values()):
        raise WireError("loss_fn_config must be a few finite numbers")
    return req


def fwdbwd_from_json(body: dict[str, Any], limits: Limits, forward_only: bool) -> FwdBwdRequest:
    """``ForwardBackwardRequest`` / ``ForwardRequest`` JSON (``forward_backward_input`` or ``forward_input``)."""
    inp = body.get("forward_input" if forward_only else "forward_backward_input")
    if not isinstance(inp, dict) or not isinstance(inp.get("data"), list):
        raise WireError("request needs forward_backward_input.data")
    if len(inp["data"]) > limits.max_data:
        raise WireError(f"{len(inp['data'])} data items, the server takes at most {limits.max_data} per request")
    data = []
    for i, d in enumerate(inp["data"]):
        if not isinstance(d, dict) or not isinstance(d.get("loss_fn_inputs"), dict):
            raise WireError(f"datum {i} needs model_input and loss_fn_inputs")
        tokens = model_input_tokens(d.get("model_input"))
        lim = limits.max_tokens_per_request
        inputs = {str(k): _tensor_from_json(v, str(k), lim) for k, v in list(d["loss_fn_inputs"].items())[:8]}
        data.append(_check_datum(tokens, inputs, i))
    config = inp.get("loss_fn_config") or {}
    if not isinstance(config, dict):
        raise WireError("loss_fn_config must be an object")
    numbers = {str(k): float(v) for k, v in config.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    req = FwdBwdRequest(
        model_id=str(body.get("model_id", "")),
        data=data,
        loss_fn=str(inp.get("loss_fn", "")),
        config=numbers,
        forward_only=forward_only,
        seq_id=body.get("seq_id") if isinstance(body.get("seq_id"), int) else None,
    )
    return _check_request(req, limits)


def fwdbwd_from_proto(raw: bytes, limits: Limits) -> FwdBwdRequest:
    """A protobuf ``tinker_public.ForwardBackwardRequest`` (tinker 0.38)."""
    msg = proto.message("ForwardBackwardRequest")
    try:
        msg.ParseFromString(raw)
    except Exception as exc:  # protobuf's DecodeError and friends
        raise WireError(f"malformed protobuf body: {exc}") from None
    if len(msg.data) > limits.max_data:
        raise WireError(f"{len(msg.data)} data items, the server takes at most {limits.max_data} per request")
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise WireError("echorl serve takes token chunks (encoded_text) only")
            if len(chunk.encoded_text.tokens) % 4:
                raise WireError("encoded_text.tokens is not int32 bytes")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
            if len(tokens) > limits.max_tokens_per_request:
                raise WireError(f"more than {limits.max_tokens_per_request} tokens in one request")
        lim = limits.max_tokens_per_request
        inputs = {k: _tensor_from_proto(v, k, lim) for k, v in list(d.loss_fn_inputs.items())[:8]}
        data.append(_check_datum(tokens, inputs, i))
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "number":
            config[k] = float(v.number)
    req = FwdBwdRequest(
        model_id=msg.model_id,
        data=data,
        loss_fn=msg.loss_fn,
        config=config,
        forward_only=bool(msg.forward_only),
        seq_id=int(msg.seq_id),
    )
    return _check_request(req, limits)


# ---------------------------------------------------------------- encoding


def wants_proto(accept: str) -> bool:
    """Protobuf only for a client that cannot read JSON for this result (tinker 0.38)."""
    accept = accept.lower()
    return PROTO in accept and JSON not in accept


def _tensor_json(arr: np.ndarray) -> dict[str, Any]:
    return {"data": arr.astype(np.float32).tolist(), "dtype": "float32", "shape": list(arr.shape)}


def fwdbwd_json(result: FwdBwdResult) -> dict[str, Any]:
    return {
        "loss_fn_output_type": "ArrayRecord",
        "loss_fn_outputs": [{k: _tensor_json(v) for k, v in out.items()} for out in result.outputs],
        "metrics": result.metrics,
    }


def fwdbwd_proto(result: FwdBwdResult) -> bytes:
    msg = proto.message("ForwardBackwardOutput")
    msg.loss_fn_output_type = "ArrayRecord"
    for k, v in result.metrics.items():
        msg.metrics[k] = float(v)
    record = msg.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(result.outputs)
    for name in result.outputs[0] if result.outputs else []:
        arrays = [out[name].astype(np.float32).ravel() for out in result.outputs]
        offsets = np.concatenate([[0], np.cumsum([a.nbytes for a in arrays])]).astype(np.int64)
        bt = record.fields[name]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = proto.DTYPE_FLOAT32
    return msg.SerializeToString()


def sample_json(result: SampleResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "sample",
        "sequences": [
            {"stop_reason": s.stop_reason, "tokens": s.tokens, "logprobs": s.logprobs} for s in result.sequences
        ],
    }
    if result.prompt_logprobs is not None:
        out["prompt_logprobs"] = result.prompt_logprobs
    return out


def sample_proto(result: SampleResult) -> bytes:
    msg = proto.message("SampleResponse")
    for s in result.sequences:
        seq = msg.sequences.add()
        seq.stop_reason = proto.STOP_REASON_STOP if s.stop_reason == "stop" else proto.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if result.prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in result.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, dtype=np.float32).tobytes()
    return msg.SerializeToString()
