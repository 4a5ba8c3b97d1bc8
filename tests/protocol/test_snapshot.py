"""Snapshots and deltas: chunking, signed manifests, verified reassembly, bit-exact deltas."""

import pytest
import torch

from echorl.protocol import ErrorCode, ProtocolError, wire
from echorl.protocol.delta import apply_delta, encode_delta
from echorl.protocol.identity import Identity
from echorl.protocol.snapshot import (
    ChunkAssembler,
    build_manifest,
    digest,
    parse_safetensors,
    safetensors_to_state_dict,
    state_dict_to_safetensors,
    verify_manifest,
    verify_result,
)

LEARNER, MALLORY = Identity.generate(), Identity.generate()


def small_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 50))
    return model.to(dtype)


def one_optimizer_step(model, lr=1e-3, dtype=torch.float32):
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    tokens = torch.randint(0, 50, (4, 6))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 50), tokens.reshape(-1))
    loss.backward()
    opt.step()


def publish(payload, result=None, **kw):
    return build_manifest(LEARNER, "run-1", 1, 0, payload, payload if result is None else result, **kw)


def test_full_snapshot_round_trip_through_chunks():
    model = small_model()
    data = state_dict_to_safetensors(model.state_dict())
    manifest, chunks = publish(data, chunk_bytes=1000)
    assert len(chunks) == -(-len(data) // 1000)
    verify_manifest(wire.decode(wire.encode(manifest)), LEARNER.peer_id, "run-1")
    assembler = ChunkAssembler(manifest)
    for ref, chunk in reversed(list(zip(manifest.chunks, chunks))):
        assembler.add(ref.digest, chunk)
    assert assembler.complete
    rebuilt = assembler.payload()
    verify_result(manifest, rebuilt)
    loaded = safetensors_to_state_dict(rebuilt)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor)


def test_altered_chunk_is_refused_and_not_stored():
    data = state_dict_to_safetensors(small_model().state_dict())
    manifest, chunks = publish(data, chunk_bytes=1000)
    assembler = ChunkAssembler(manifest)
    poisoned = bytearray(chunks[1])
    poisoned[10] ^= 1
    with pytest.raises(ProtocolError) as err:
        assembler.add(manifest.chunks[1].digest, bytes(poisoned))
    assert err.value.code is ErrorCode.BAD_CHUNK
    assert manifest.chunks[1].digest in assembler.missing()
    with pytest.raises(ProtocolError):
        assembler.add(digest(b"not in the manifest"), b"not in the manifest")
    with pytest.raises(ProtocolError):
        assembler.payload()


def test_manifest_signature_and_consistency_checks():
    data = state_dict_to_safetensors(small_model().state_dict())
    manifest, _ = publish(data, chunk_bytes=1000)
    with pytest.raises(ProtocolError) as err:
        verify_manifest(manifest, MALLORY.peer_id)
    assert err.value.code is ErrorCode.WRONG_SIGNER
    tampered = manifest.model_copy(update={"version": 99})
    with pytest.raises(ProtocolError) as err:
        verify_manifest(tampered, LEARNER.peer_id)
    assert err.value.code is ErrorCode.BAD_SIGNATURE
    # A forger with its own key signing a manifest that names the learner: refused.
    forged = manifest.model_copy(update={"signature": MALLORY.sign(wire.canonical_bytes(manifest))})
    with pytest.raises(ProtocolError):
        verify_manifest(forged, LEARNER.peer_id)
    with pytest.raises(ProtocolError):
        verify_manifest(manifest, LEARNER.peer_id, run_id="another-run")


def test_inconsistent_manifest_refused_even_if_signed():
    data = state_dict_to_safetensors(small_model().state_dict())
    manifest, _ = publish(data, chunk_bytes=1000)
    bad = wire.sign(manifest.model_copy(update={"payload_bytes": manifest.payload_bytes + 1}), LEARNER)
    with pytest.raises(ProtocolError) as err:
        verify_manifest(bad, LEARNER.peer_id)
    assert err.value.code is ErrorCode.BAD_MANIFEST


def test_result_with_altered_tensor_refused():
    data = state_dict_to_safetensors(small_model().state_dict())
    manifest, _ = publish(data)
    altered = bytearray(data)
    altered[-1] ^= 0x80
    with pytest.raises(ProtocolError):
        verify_result(manifest, bytes(altered))


@pytest.mark.parametrize(
    "garbage", [b"", b"\xff" * 8, b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}", b"\x02\x00\x00\x00\x00\x00\x00\x00[]"]
)
def test_parse_safetensors_refuses_garbage(garbage):
    with pytest.raises(ProtocolError):
        parse_safetensors(garbage)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_delta_of_real_optimizer_step_is_bit_exact(dtype):
    model = small_model(dtype)
    before = state_dict_to_safetensors(model.state_dict())
    one_optimizer_step(model, lr=1e-4)
    after = state_dict_to_safetensors(model.state_dict())
    assert before != after
    delta = encode_delta(before, after)
    rebuilt = apply_delta(before, delta)
    assert rebuilt == after
    # The delta travels as a manifest of kind "delta" that proves the result.
    manifest, chunks = build_manifest(
        LEARNER, "run-1", 2, 1, delta, after, kind="delta", base_version=1, chunk_bytes=512
    )
    verify_manifest(manifest, LEARNER.peer_id)
    assembler = ChunkAssembler(manifest)
    for ref, chunk in zip(manifest.chunks, chunks):
        assembler.add(ref.digest, chunk)
    verify_result(manifest, apply_delta(before, assembler.payload()))


def test_delta_of_sparse_change_is_small():
    model = small_model()
    before = state_dict_to_safetensors(model.state_dict())
    with torch.no_grad():
        model[1].weight[0, :4] += 1.0
    after = state_dict_to_safetensors(model.state_dict())
    delta = encode_delta(before, after)
    assert len(delta) < len(after) / 20
    assert apply_delta(before, delta) == after


def test_delta_refuses_wrong_base_and_changed_shapes():
    model = small_model()
    v0 = state_dict_to_safetensors(model.state_dict())
    one_optimizer_step(model)
    v1 = state_dict_to_safetensors(model.state_dict())
    one_optimizer_step(model)
    v2 = state_dict_to_safetensors(model.state_dict())
    delta = encode_delta(v1, v2)
    with pytest.raises(ProtocolError):
        apply_delta(v0, delta)
    other = state_dict_to_safetensors({"w": torch.zeros(3)})
    with pytest.raises(ValueError, match="full snapshot"):
        encode_delta(v0, other)


def test_corrupted_delta_payload_refused():
    model = small_model()
    v0 = state_dict_to_safetensors(model.state_dict())
    one_optimizer_step(model)
    v1 = state_dict_to_safetensors(model.state_dict())
    delta = bytearray(encode_delta(v0, v1))
    for pos in (0, len(delta) // 2, len(delta) - 5):
        broken = bytearray(delta)
        broken[pos] ^= 0xFF
        try:
            result = apply_delta(v0, bytes(broken))
        except ProtocolError:
            continue
        assert result == v1  # a flip in a don't-care byte must still give the exact result
