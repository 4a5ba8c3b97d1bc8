"""Episodes on the wire: the optional fields leave single-turn messages byte for byte as before
(so a node or learner that predates them signs and verifies the same bytes), and are strict and
bounded when present."""

from __future__ import annotations

import secrets

import msgpack
import pytest

from echorl.protocol import wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity
from echorl.protocol.messages import (
    EpisodeSpec,
    Lease,
    LeasePrompt,
    RolloutGroup,
    Sample,
    SamplingSpec,
    Submit,
)

SPEC = dict(env="poker", options={"opponent": "fixed", "max_turns": 2}, seed=2**62, max_turns=2, max_tokens=2048)


def _submit(ident: Identity, **sample) -> Submit:
    s = Sample(token_ids=[5, 6, 7], logprobs=[-0.5, 0.0, -1.0], finish_reason="stop", reward_hint=1.0, **sample)
    return wire.sign(
        Submit(
            run_id="r",
            lease_id="L1",
            peer_id=ident.peer_id,
            behaviour_version=3,
            groups=[RolloutGroup(prompt_id="p", samples=[s])],
            generate_seconds=0.5,
            nonce=secrets.token_bytes(16),
        ),
        ident,
    )


def test_single_turn_messages_keep_their_old_encoding_and_signatures():
    ident = Identity.generate()
    msg = _submit(ident)
    raw = msgpack.unpackb(wire.encode(msg))
    assert set(raw["groups"][0]["samples"][0]) == {"token_ids", "logprobs", "finish_reason", "reward_hint"}
    wire.verify(wire.decode(wire.encode(msg)), ident.peer_id)  # an old peer's bytes verify here too
    lease = Lease(
        lease_id="L",
        run_id="r",
        prompts=[LeasePrompt(prompt_id="p", text="1+1=")],
        group_size=2,
        sampling=SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=3, stop=[]),
        min_version=0,
        deadline_s=5.0,
    )
    assert set(msgpack.unpackb(wire.encode(lease))["prompts"][0]) == {"prompt_id", "text"}


def test_episode_fields_round_trip_and_are_signed():
    ident = Identity.generate()
    msg = _submit(ident, model_mask=[True, False, True])
    back = wire.decode(wire.encode(msg))
    assert back.groups[0].samples[0].model_mask == [True, False, True]
    wire.verify(back, ident.peer_id)
    forged = back.model_copy(
        update={
            "groups": [
                RolloutGroup(
                    prompt_id="p",
                    samples=[back.groups[0].samples[0].model_copy(update={"model_mask": [True, True, True]})],
                )
            ]
        }
    )
    with pytest.raises(ProtocolError) as err:
        wire.verify(forged, ident.peer_id)
    assert err.value.code == ErrorCode.BAD_SIGNATURE
    lp = LeasePrompt(prompt_id="p", text="K1:=", episode=EpisodeSpec(**SPEC))
    assert LeasePrompt.model_validate(msgpack.unpackb(msgpack.packb(lp.model_dump()))) == lp


@pytest.mark.parametrize(
    "bad",
    [
        {"seed": -1},
        {"seed": 2**63},
        {"max_turns": 0},
        {"max_turns": 257},
        {"max_tokens": 0},
        {"env": ""},
        {"options": {"x": [1, 2]}},
        {"max_turns": 2.0},
    ],
)
def test_episode_spec_is_strict_and_bounded(bad):
    body = {
        "type": "lease",
        "lease_id": "L",
        "run_id": "r",
        "group_size": 2,
        "min_version": 0,
        "deadline_s": 5.0,
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 1, "stop": []},
        "prompts": [{"prompt_id": "p", "text": "K1:=", "episode": {**SPEC, **bad}}],
    }
    with pytest.raises(ProtocolError) as err:
        wire.decode(msgpack.packb(body))
    assert err.value.code == ErrorCode.SCHEMA


def test_mask_must_align_with_the_transcript():
    body = msgpack.unpackb(wire.encode(_submit(Identity.generate(), model_mask=[True, False, True])))
    body["groups"][0]["samples"][0]["model_mask"] = [True, False]
    with pytest.raises(ProtocolError) as err:
        wire.decode(msgpack.packb(body))
    assert err.value.code == ErrorCode.SCHEMA
