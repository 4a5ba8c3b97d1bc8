"""A node's receipts: the learner's signed proof of each accepted submission, kept on disk.

The node verifies every ``Receipt`` against the pinned learner, its own peer ID, the run and the
lease it answered before keeping it (a bad one is counted and dropped, never stored). The file is
JSON lines, ``{"receipt": "<base64 of the signed msgpack>"}``, one per receipt, appended with a
single ``write`` on an ``O_APPEND`` descriptor and fsynced: a crash can only leave a torn last
line, which readers report and skip. ``verify_file`` re-checks a file offline (``echorl ledger
--receipts``): each signature against the learner's peer ID, so an altered or forged receipt
fails, and a copied line counts once.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from echorl.protocol import wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.messages import Receipt

MAX_LINE_BYTES = 4096  # a receipt is ~400 bytes of base64; anything longer is not one


def check(
    receipt: Receipt,
    learner_id: str,
    peer_id: str | None = None,
    run_id: str | None = None,
    lease_id: str | None = None,
) -> None:
    """Raise ``ProtocolError`` unless ``learner_id`` signed ``receipt`` and it names this node,
    run and lease (each only when given)."""
    wire.verify(receipt, expected_signer=learner_id)
    for what, want, got in (
        ("peer", peer_id, receipt.peer_id),
        ("run", run_id, receipt.run_id),
        ("lease", lease_id, receipt.lease_id),
    ):
        if want is not None and want != got:
            raise ProtocolError(ErrorCode.SCHEMA, f"receipt names {what} {got!r}, expected {want!r}")


def encode_line(receipt: Receipt) -> bytes:
    return (json.dumps({"receipt": base64.b64encode(wire.encode(receipt)).decode()}) + "\n").encode()


def decode_line(line: bytes) -> Receipt:
    """One file line → a decoded (not yet verified) receipt; ``ProtocolError`` if it is not one."""
    if len(line) > MAX_LINE_BYTES:
        raise ProtocolError(ErrorCode.OVERSIZED, f"line of {len(line)} bytes")
    try:
        obj = json.loads(line)
        raw = base64.b64decode(obj["receipt"], validate=True)
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise ProtocolError(ErrorCode.MALFORMED, f"not a receipt line: {type(exc).__name__}") from None
    msg = wire.decode(raw, expect=Receipt)
    assert isinstance(msg, Receipt)
    return msg


class ReceiptLog:
    """Append-only receipts file of one node."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def append(self, receipt: Receipt) -> None:
        """One atomic append (single write, O_APPEND) made durable before returning."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, encode_line(receipt))
            os.fsync(fd)
        finally:
            os.close(fd)


def read_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                yield n, line[: MAX_LINE_BYTES + 1]


@dataclass
class Verified:
    """What a receipts file proves: the receipts that verify (a copied line counts once; ``seq``
    restarts with the learner process, so it is not the key) and why each other line was refused."""

    receipts: list[Receipt] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)
    lines: list[int] = field(default_factory=list)  # the line number of each receipt

    def learners(self) -> set[str]:
        return {r.learner_peer_id for r in self.receipts}


def verify_file(path: str | Path, learner_id: str | None = None) -> Verified:
    """Check every line offline. With ``learner_id`` only that learner's signature is accepted;
    without it each receipt must verify against the learner it names (then ``learners()`` says
    whose receipts they are: a self-signed forgery shows up as another learner)."""
    out = Verified()
    seen: set[bytes] = set()  # signatures: Ed25519 is deterministic, so a copied line repeats one
    for n, line in read_lines(path):
        try:
            receipt = decode_line(line)
            check(receipt, learner_id or receipt.learner_peer_id)
        except ProtocolError as exc:
            out.refused.append((n, f"{exc.code.value}: {exc}"[:200]))
            continue
        if receipt.signature in seen:
            out.refused.append((n, f"duplicate of receipt {receipt.seq}"))
            continue
        seen.add(receipt.signature)
        out.receipts.append(receipt)
        out.lines.append(n)
    return out
