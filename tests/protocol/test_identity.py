"""Identity: persistent keys, libp2p-compatible peer IDs, signatures."""

import os
import stat

import pytest
from keyfiles import KEY_PROBLEMS, unusable_key

from echorl.protocol import ErrorCode, ProtocolError
from echorl.protocol.identity import (
    Identity,
    KeyFileError,
    load_identity,
    load_or_create_identity,
    peer_id_from_public_key,
    public_key_from_peer_id,
    verify_peer_signature,
    verify_signature,
)


def test_key_file_created_with_mode_0600_and_reloaded(tmp_path):
    path = tmp_path / "keys" / "node.key"
    first = load_or_create_identity(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_or_create_identity(path)
    assert again.peer_id == first.peer_id and again.seed == first.seed


def test_world_readable_key_file_is_refused(tmp_path):
    path = tmp_path / "node.key"
    load_or_create_identity(path)
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="chmod 600"):
        load_identity(path)


@pytest.mark.parametrize("kind", KEY_PROBLEMS)
def test_every_key_file_problem_is_one_key_file_error(tmp_path, kind):
    path, words = unusable_key(tmp_path, kind)
    with pytest.raises(KeyFileError, match=words) as err:
        load_or_create_identity(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    assert isinstance(err.value, ValueError)  # what every role's pre-flight check catches (exit 2)


def test_truncated_key_file_is_refused(tmp_path):
    path = tmp_path / "node.key"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"short")
    os.close(fd)
    with pytest.raises(ValueError, match="32-byte"):
        load_identity(path)


def test_peer_id_equals_py_libp2p_host_id():
    from libp2p import new_host
    from libp2p.crypto.ed25519 import create_new_key_pair

    identity = Identity.generate()
    host = new_host(key_pair=create_new_key_pair(identity.seed))
    assert str(host.get_id()) == identity.peer_id
    assert identity.peer_id.startswith("12D3KooW")
    assert public_key_from_peer_id(identity.peer_id) == identity.public_key


def test_sign_and_verify_and_refusals():
    alice, mallory = Identity.generate(), Identity.generate()
    sig = alice.sign(b"canonical bytes")
    assert verify_signature(alice.public_key, b"canonical bytes", sig)
    assert not verify_signature(alice.public_key, b"canonical bytez", sig)
    assert not verify_signature(mallory.public_key, b"canonical bytes", sig)
    assert not verify_signature(alice.public_key, b"canonical bytes", sig[:-1])
    verify_peer_signature(alice.peer_id, b"canonical bytes", sig)
    with pytest.raises(ProtocolError) as err:
        verify_peer_signature(mallory.peer_id, b"canonical bytes", sig)
    assert err.value.code is ErrorCode.BAD_SIGNATURE


@pytest.mark.parametrize("bad", ["", "0OIl", "12D3KooW", "Qm" + "1" * 44])
def test_malformed_peer_ids_raise_protocol_error(bad):
    with pytest.raises(ProtocolError):
        public_key_from_peer_id(bad)


def test_public_key_length_checked():
    with pytest.raises(ProtocolError):
        peer_id_from_public_key(b"\x01" * 31)
