"""Peer identity: persistent Ed25519 keys, libp2p peer IDs derived from them, signatures.

A peer ID here is byte-for-byte the libp2p one: base58btc of the identity multihash of the
protobuf-encoded public key (``08 01 12 20 || key``). It is computed without importing libp2p,
so the protocol plane stays light; tests check it against a real py-libp2p host.

Key file format: the 32-byte raw Ed25519 seed, written with mode 0600. Loading a file that is
readable by group/others is refused, like ssh does. Every problem with a key file (open mode,
wrong size, a directory, a path that cannot be created) is one :class:`KeyFileError` worded here,
which every role prints as one line (exit 2).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import ErrorCode, ProtocolError

SEED_BYTES = 32
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
# protobuf PublicKey{Type: Ed25519 (1), Data: 32 bytes}; then multihash identity (0x00), len 36.
_PROTOBUF_ED25519_PREFIX = b"\x08\x01\x12\x20"
_IDENTITY_MULTIHASH_PREFIX = b"\x00\x24"


def peer_id_from_public_key(public_key: bytes) -> str:
    """The libp2p peer ID (base58 string, ``12D3KooW…``) of a raw Ed25519 public key."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ProtocolError(ErrorCode.SCHEMA, f"ed25519 public key must be 32 bytes, got {len(public_key)}")
    return base58.b58encode(_IDENTITY_MULTIHASH_PREFIX + _PROTOBUF_ED25519_PREFIX + public_key).decode()


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Inverse of :func:`peer_id_from_public_key`: Ed25519 peer IDs embed their key."""
    try:
        raw = base58.b58decode(peer_id.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise ProtocolError(ErrorCode.SCHEMA, f"peer id is not base58: {exc}") from None
    prefix = _IDENTITY_MULTIHASH_PREFIX + _PROTOBUF_ED25519_PREFIX
    if len(raw) != len(prefix) + PUBLIC_KEY_BYTES or not raw.startswith(prefix):
        raise ProtocolError(ErrorCode.SCHEMA, "peer id is not an inlined Ed25519 key")
    return raw[len(prefix) :]


SHORT_ID_CHARS = 8


def short_id(peer_id: str) -> str:
    """The one short form of a peer ID used in logs, status, metrics and the ledger: its last 8
    characters (the head is the same ``12D3KooW`` for every Ed25519 peer)."""
    return str(peer_id)[-SHORT_ID_CHARS:]


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature of ``message`` under ``public_key``."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


def verify_peer_signature(peer_id: str, message: bytes, signature: bytes) -> None:
    """Raise ``ProtocolError(BAD_SIGNATURE)`` unless ``peer_id``'s key signed ``message``."""
    if not verify_signature(public_key_from_peer_id(peer_id), message, signature):
        raise ProtocolError(ErrorCode.BAD_SIGNATURE, f"signature does not verify for …{short_id(peer_id)}")


@dataclass(frozen=True)
class Identity:
    """An Ed25519 key pair and the peer ID derived from it."""

    seed: bytes

    def __post_init__(self) -> None:
        if len(self.seed) != SEED_BYTES:
            raise ValueError(f"ed25519 seed must be {SEED_BYTES} bytes, got {len(self.seed)}")

    @classmethod
    def generate(cls) -> Identity:
        key = Ed25519PrivateKey.generate()
        raw = key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        return cls(raw)

    # cached: the learner signs a receipt per submission, and deriving the key and the ID took
    # ~70 µs a call (1,000 peers, issue 27); the seed never changes (frozen)
    @cached_property
    def _private_key(self) -> Ed25519PrivateKey:
        return Ed25519PrivateKey.from_private_bytes(self.seed)

    @cached_property
    def public_key(self) -> bytes:
        return self._private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @cached_property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    def sign(self, message: bytes) -> bytes:
        return self._private_key.sign(message)

    def __repr__(self) -> str:  # never print the seed
        return f"Identity(peer_id={self.peer_id})"


def save_identity(identity: Identity, path: str | Path) -> None:
    """Write the seed to ``path`` with mode 0600, atomically (never a half-written key)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, identity.seed)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


class KeyFileError(ValueError):
    """A key file that cannot be used (unreadable by us, readable by others, not a seed, not a
    file, or not creatable): one line that says what to do; roles print it and exit 2."""


def load_identity(path: str | Path) -> Identity:
    """Read a key file; refuse one that others can read or that is not a 32-byte seed
    (:class:`KeyFileError`, the one place every role's key problems are worded)."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise KeyFileError(f"key file {path} does not exist (echorl keygen --key {path} creates one)") from None
    except OSError as exc:
        raise KeyFileError(f"key file {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise KeyFileError(f"key file {path} is {what}; give --key a file path (it is created if missing)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise KeyFileError(f"key file {path} has mode {mode:o} (others may read it); run: chmod 600 {path}")
    try:
        seed = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"key file {path}: {exc.strerror or exc}") from None
    if len(seed) != SEED_BYTES:
        raise KeyFileError(
            f"key file {path} holds {len(seed)} bytes, not a {SEED_BYTES}-byte Ed25519 seed (damaged or not an "
            f"echorl key); restore it, or point --key at a new file for a new identity"
        )
    return Identity(seed)


def load_or_create_identity(path: str | Path) -> Identity:
    """The peer's persistent key: loaded if ``path`` exists, else generated and saved
    (:class:`KeyFileError` if it cannot be)."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        return load_identity(path)
    identity = Identity.generate()
    try:
        save_identity(identity, path)
    except OSError as exc:
        where = exc.filename or path
        raise KeyFileError(f"cannot create key file {path}: {where}: {exc.strerror or exc}") from None
    return identity
