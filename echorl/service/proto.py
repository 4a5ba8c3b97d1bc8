"""The protobuf messages of the Tinker wire that echorl reads and writes, declared here.

tinker 0.38 POSTs ``/api/v1/forward_backward`` as ``application/x-protobuf`` and asks for
``SampleResponse`` and ``ForwardBackwardOutput`` futures in protobuf (``Accept:
application/x-protobuf``, no JSON alternative); tinker 0.21 sends JSON but accepts either. The
schema is package ``tinker_public`` (proto3) as the client's ``tinker/proto/tinker_public_pb2.py``
describes it (tinker 0.38.0; read with ``DESCRIPTOR.CopyToProto``). Only the fields echorl uses
are declared: protobuf skips unknown fields when parsing, so a client that sends more (images,
provenance spans) still parses, and what echorl writes is a subset the client reads.

The message classes are built at import from a ``FileDescriptorProto`` written below (no
generated code, no ``protoc``); field numbers are the contract.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PACKAGE = "tinker_public"
F = descriptor_pb2.FieldDescriptorProto

DTYPE_FLOAT32 = 1
DTYPE_INT64 = 2
DTYPE_INT32 = 3
STOP_REASON_STOP = 0
STOP_REASON_LENGTH = 1

# message -> [(number, name, type, label, type_name)]; REP = repeated, OPT = singular
OPT, REP = F.LABEL_OPTIONAL, F.LABEL_REPEATED
_MESSAGES: dict[str, list[tuple[int, str, int, int, str]]] = {
    "Tensor": [
        (1, "dense", F.TYPE_BYTES, OPT, ""),
        (2, "sparse_csr", F.TYPE_MESSAGE, OPT, "SparseCsr"),
        (3, "dtype", F.TYPE_ENUM, OPT, "DType"),
        (4, "shape", F.TYPE_INT64, REP, ""),
    ],
    "SparseCsr": [
        (1, "values", F.TYPE_BYTES, OPT, ""),
        (2, "crow_indices", F.TYPE_BYTES, OPT, ""),
        (3, "col_indices", F.TYPE_BYTES, OPT, ""),
    ],
    "EncodedTextChunk": [(1, "tokens", F.TYPE_BYTES, OPT, "")],
    "ImageChunk": [(1, "data", F.TYPE_BYTES, OPT, ""), (2, "format", F.TYPE_STRING, OPT, "")],
    "Chunk": [
        (1, "encoded_text", F.TYPE_MESSAGE, OPT, "EncodedTextChunk"),
        (2, "image", F.TYPE_MESSAGE, OPT, "ImageChunk"),
    ],
    "Datum": [
        (1, "model_input", F.TYPE_MESSAGE, REP, "Chunk"),
        (2, "loss_fn_inputs", F.TYPE_MESSAGE, REP, "Datum.LossFnInputsEntry"),
    ],
    "LossConfigValue": [(1, "number", F.TYPE_DOUBLE, OPT, ""), (2, "text", F.TYPE_STRING, OPT, "")],
    "ForwardBackwardRequest": [
        (1, "model_id", F.TYPE_STRING, OPT, ""),
        (2, "seq_id", F.TYPE_INT32, OPT, ""),
        (3, "data", F.TYPE_MESSAGE, REP, "Datum"),
        (4, "loss_fn", F.TYPE_STRING, OPT, ""),
        (5, "loss_fn_config", F.TYPE_MESSAGE, REP, "ForwardBackwardRequest.LossFnConfigEntry"),
        (6, "forward_only", F.TYPE_BOOL, OPT, ""),
        (7, "loss_fn_config_v2", F.TYPE_MESSAGE, REP, "ForwardBackwardRequest.LossFnConfigV2Entry"),
    ],
    "BatchedTensor": [
        (1, "data", F.TYPE_BYTES, OPT, ""),
        (2, "offsets", F.TYPE_BYTES, OPT, ""),
        (3, "dtype", F.TYPE_ENUM, OPT, "DType"),
        (4, "trailing_shape", F.TYPE_INT64, REP, ""),
    ],
    "ArrayRecord": [
        (1, "type_tag", F.TYPE_STRING, OPT, ""),
        (2, "fields", F.TYPE_MESSAGE, REP, "ArrayRecord.FieldsEntry"),
        (3, "num_datums", F.TYPE_INT64, OPT, ""),
    ],
    "ForwardBackwardOutput": [
        (1, "loss_fn_output_type", F.TYPE_STRING, OPT, ""),
        (2, "loss_fn_outputs", F.TYPE_MESSAGE, REP, "ArrayRecord"),
        (3, "metrics", F.TYPE_MESSAGE, REP, "ForwardBackwardOutput.MetricsEntry"),
    ],
    "SampledSequence": [
        (1, "stop_reason", F.TYPE_ENUM, OPT, "StopReason"),
        (2, "tokens", F.TYPE_BYTES, OPT, ""),
        (3, "logprobs", F.TYPE_BYTES, OPT, ""),
    ],
    "SampleResponse": [
        (1, "sequences", F.TYPE_MESSAGE, REP, "SampledSequence"),
        (2, "prompt_logprobs", F.TYPE_BYTES, OPT, ""),
    ],
}
# map fields: parent -> [(entry name, value type, value type_name)]
_MAPS: dict[str, list[tuple[str, int, str]]] = {
    "Datum": [("LossFnInputsEntry", F.TYPE_MESSAGE, "Tensor")],
    "ForwardBackwardRequest": [
        ("LossFnConfigEntry", F.TYPE_DOUBLE, ""),
        ("LossFnConfigV2Entry", F.TYPE_MESSAGE, "LossConfigValue"),
    ],
    "ArrayRecord": [("FieldsEntry", F.TYPE_MESSAGE, "BatchedTensor")],
    "ForwardBackwardOutput": [("MetricsEntry", F.TYPE_DOUBLE, "")],
}
_ENUMS = {
    "DType": ["DTYPE_UNSPECIFIED", "DTYPE_FLOAT32", "DTYPE_INT64", "DTYPE_INT32", "DTYPE_BFLOAT16"],
    "StopReason": ["STOP_REASON_STOP", "STOP_REASON_LENGTH"],
}
#: oneof groups (proto3 ``oneof``), by message: (group name, member field names)
_ONEOFS = {
    "Tensor": ("encoding", {"dense", "sparse_csr"}),
    "Chunk": ("chunk", {"encoded_text", "image"}),
    "LossConfigValue": ("value", {"number", "text"}),
}


def _add_field(msg: Any, number: int, name: str, ftype: int, label: int, type_name: str) -> Any:
    field = msg.field.add(number=number, name=name, type=ftype, label=label)
    if type_name:
        field.type_name = f".{PACKAGE}.{type_name}"
    return field


def _file() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(name="echorl_tinker_public.proto", package=PACKAGE, syntax="proto3")
    for name, values in _ENUMS.items():
        enum = fd.enum_type.add(name=name)
        for i, value in enumerate(values):
            enum.value.add(name=value, number=i)
    for name, fields in _MESSAGES.items():
        msg = fd.message_type.add(name=name)
        for entry, vtype, vname in _MAPS.get(name, []):
            nested = msg.nested_type.add(name=entry)
            nested.options.map_entry = True
            _add_field(nested, 1, "key", F.TYPE_STRING, OPT, "")
            _add_field(nested, 2, "value", vtype, OPT, vname)
        group = _ONEOFS.get(name)
        if group:
            msg.oneof_decl.add(name=group[0])
        for number, fname, ftype, label, tname in fields:
            field = _add_field(msg, number, fname, ftype, label, tname)
            if group and fname in group[1]:
                field.oneof_index = 0
    return fd


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())


def message(name: str) -> Any:
    """A new, empty message of ``tinker_public.<name>``."""
    return message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.{name}"))()
