"""Wire format: round trips, strict decoding, fuzzing, framing, signatures and replay fields."""

import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from protocol_examples import example_messages

from echorl.protocol import ErrorCode, ProtocolError, limits, wire
from echorl.protocol import messages as m
from echorl.protocol.identity import Identity

NODE, LEARNER, MALLORY = Identity.generate(), Identity.generate(), Identity.generate()
EXAMPLES = example_messages(NODE, LEARNER)
ENCODED = [wire.encode(msg) for msg in EXAMPLES]


def raw(msg: m.Message) -> dict:
    return msgpack.unpackb(wire.encode(msg), raw=False)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def code_of(data: bytes) -> ErrorCode:
    with pytest.raises(ProtocolError) as err:
        wire.decode(data)
    return err.value.code


def test_every_message_type_has_an_example():
    assert {type(x) for x in EXAMPLES} == set(m.MESSAGE_TYPES.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(msg):
    assert wire.decode(wire.encode(msg)) == msg


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: type(x).__name__)
def test_missing_and_extra_fields_are_schema_errors(msg):
    body = raw(msg)
    for key in [k for k in body if k != "type"]:
        broken = dict(body)
        del broken[key]
        if key == "signature":  # has a default; absence is caught by verification instead
            continue
        if key == "instance":  # has a default (empty: the node takes no part in the identity check)
            continue
        if key == "receipt":  # optional: a learner without receipts still answers a valid SubmitAccepted
            continue
        if key == "incarnation" and not isinstance(msg, m.JoinAccepted):  # optional outside the join answer
            continue
        assert code_of(pack(broken)) is ErrorCode.SCHEMA, key
    assert code_of(pack({**body, "surprise": 1})) is ErrorCode.SCHEMA


def test_unknown_type_and_non_map():
    assert code_of(pack({"type": "pickle"})) is ErrorCode.UNKNOWN_TYPE
    assert code_of(pack({"no_type": 1})) is ErrorCode.UNKNOWN_TYPE
    assert code_of(pack([1, 2, 3])) is ErrorCode.MALFORMED
    assert code_of(b"") is ErrorCode.MALFORMED
    assert code_of(pack({"type": "status_request"}) + b"\x00") is ErrorCode.MALFORMED


def test_wrong_types_are_refused_without_coercion():
    body = raw(EXAMPLES[2])  # LeaseRequest
    assert code_of(pack({**body, "version": "4"})) is ErrorCode.SCHEMA
    assert code_of(pack({**body, "version": 4.0})) is ErrorCode.SCHEMA
    assert code_of(pack({**body, "max_prompts": True})) is ErrorCode.SCHEMA
    assert code_of(pack({**body, "max_prompts": 0})) is ErrorCode.SCHEMA


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_refused(bad):
    submit = raw(EXAMPLES[5])
    submit["groups"][0]["samples"][0]["logprobs"][0] = bad
    assert code_of(pack(submit)) is ErrorCode.SCHEMA
    assert code_of(pack({**raw(EXAMPLES[0]), "timestamp": bad})) is ErrorCode.SCHEMA


def test_positive_logprob_and_misaligned_sample_refused():
    submit = raw(EXAMPLES[5])
    submit["groups"][0]["samples"][0]["logprobs"][0] = 0.5
    assert code_of(pack(submit)) is ErrorCode.SCHEMA
    submit = raw(EXAMPLES[5])
    submit["groups"][0]["samples"][0]["token_ids"].append(9)
    assert code_of(pack(submit)) is ErrorCode.SCHEMA


def test_ext_types_and_timestamps_refused():
    ext = msgpack.packb({"type": "status_request", "x": msgpack.ExtType(5, b"boom")})
    assert code_of(ext) is ErrorCode.MALFORMED
    stamp = msgpack.packb({"type": "error", "code": "x", "detail": msgpack.Timestamp(1, 0)}, datetime=False)
    assert code_of(stamp) in (ErrorCode.SCHEMA, ErrorCode.MALFORMED)


def test_oversized_fields_and_frames():
    assert (
        code_of(pack({"type": "error", "code": "x", "detail": "a" * (limits.MAX_STR_BYTES + 1)})) is ErrorCode.OVERSIZED
    )
    chunk = {"type": "chunk", "digest": b"d" * 32, "data": b"x" * (limits.MAX_CHUNK_BYTES + 1)}
    assert code_of(pack(chunk)) is ErrorCode.OVERSIZED
    assert code_of(b"\x00" * (limits.MAX_FRAME_BYTES + 1)) is ErrorCode.OVERSIZED
    lease = raw(EXAMPLES[3])
    lease["prompts"] = lease["prompts"] * (limits.MAX_PROMPTS_PER_LEASE + 1)
    assert code_of(pack(lease)) is ErrorCode.SCHEMA


def test_deep_nesting_refused():
    nested = [[[[[[[[[[[[1]]]]]]]]]]]]
    assert (
        code_of(pack({"type": "status", "run_id": "r", "learner": {"a": nested}, "peers": []})) is ErrorCode.MALFORMED
    )


def test_expect_narrows_type():
    with pytest.raises(ProtocolError) as err:
        wire.decode(ENCODED[2], expect=m.Lease)
    assert err.value.code is ErrorCode.UNKNOWN_TYPE
    assert isinstance(wire.decode(ENCODED[3], expect=m.Lease), m.Lease)


def test_frames():
    payload = ENCODED[0]
    framed = wire.frame(payload)
    assert wire.frame_length(framed[:4]) == len(payload) and framed[4:] == payload
    with pytest.raises(ProtocolError) as err:
        wire.frame_length((limits.MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    assert err.value.code is ErrorCode.OVERSIZED
    with pytest.raises(ProtocolError):
        wire.frame_length(b"\x00\x01")
    with pytest.raises(ProtocolError):
        wire.frame(b"x" * (limits.MAX_FRAME_BYTES + 1))


# --- signatures --------------------------------------------------------------------------------
SIGNED = [x for x in EXAMPLES if x.SIGNED]


@pytest.mark.parametrize("msg", SIGNED, ids=lambda x: type(x).__name__)
def test_signed_messages_verify_after_round_trip(msg):
    names_learner = "learner_peer_id" in type(msg).model_fields  # a Receipt names both: the learner signs
    signer = NODE if getattr(msg, "peer_id", None) == NODE.peer_id and not names_learner else LEARNER
    wire.verify(wire.decode(wire.encode(msg)), expected_signer=signer.peer_id)


def test_tampered_submit_fails_signature():
    submit = EXAMPLES[5]
    forged = submit.model_copy(update={"behaviour_version": submit.behaviour_version + 1})
    with pytest.raises(ProtocolError) as err:
        wire.verify(forged, expected_signer=NODE.peer_id)
    assert err.value.code is ErrorCode.BAD_SIGNATURE


def test_submit_signed_by_other_key_refused():
    # Mallory signs a submission that names NODE as its author.
    submit = EXAMPLES[5]
    forged = submit.model_copy(update={"signature": MALLORY.sign(wire.canonical_bytes(submit))})
    with pytest.raises(ProtocolError) as err:
        wire.verify(forged)
    assert err.value.code is ErrorCode.BAD_SIGNATURE
    # A valid signature, but the stream's remote peer is someone else.
    with pytest.raises(ProtocolError) as err:
        wire.verify(submit, expected_signer=MALLORY.peer_id)
    assert err.value.code is ErrorCode.WRONG_SIGNER


def test_cannot_sign_for_another_peer():
    with pytest.raises(ValueError):
        wire.sign(EXAMPLES[5], MALLORY)


def test_canonical_bytes_independent_of_map_order():
    submit = EXAMPLES[5]
    reordered = dict(reversed(list(raw(submit).items())))
    assert wire.canonical_bytes(wire.decode(pack(reordered))) == wire.canonical_bytes(submit)
    wire.verify(wire.decode(pack(reordered)), expected_signer=NODE.peer_id)


# --- fuzzing -----------------------------------------------------------------------------------
def _decode_only_protocol_errors(data: bytes) -> None:
    try:
        wire.decode(data)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes(data):
    _decode_only_protocol_errors(data)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(ENCODED),
    st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=8),
    st.integers(min_value=0),
)
def test_fuzz_mutated_valid_frames(valid, flips, cut):
    data = bytearray(valid)
    for pos, value in flips:
        data[pos % len(data)] = value
    _decode_only_protocol_errors(bytes(data))
    _decode_only_protocol_errors(bytes(data[: cut % (len(data) + 1)]))


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(EXAMPLES), st.data())
def test_fuzz_field_substitution(msg, data):
    body = raw(msg)
    key = data.draw(st.sampled_from(sorted(body)))
    body[key] = data.draw(json_like)
    try:
        decoded = wire.decode(pack(body))
    except ProtocolError:
        return
    if decoded.SIGNED and key != "signature" and decoded != msg:
        with pytest.raises(ProtocolError):
            wire.verify(decoded)
