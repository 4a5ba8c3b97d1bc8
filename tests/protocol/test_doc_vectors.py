"""docs/protocol.md's worked examples (§13) and its list of signed messages (§5) are test vectors:
each is rebuilt from the implementation and compared, so the contract a foreign peer is written
from cannot drift from the code (issue 24, finding 8)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from echorl.protocol import messages as m
from echorl.protocol import wire
from echorl.protocol.identity import Identity

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
EXAMPLES = DOC[DOC.index("## 13. Worked examples") :]


def _block_bytes(block: str) -> bytes:
    """The hex of a code block: each line's text before a run of 2+ spaces (the annotation)."""
    return bytes.fromhex("".join(re.split(r"\s{2,}", line.strip())[0].replace(" ", "") for line in block.splitlines()))


def _blocks() -> list[bytes]:
    return [_block_bytes(b) for b in re.findall(r"```\n(.*?)```", EXAMPLES, re.S)]


def _after(label: str, pattern: str) -> str:
    found = re.search(pattern, EXAMPLES[EXAMPLES.index(label) :], re.S)
    assert found, f"{label}: no {pattern!r}"
    return found.group(1)


def test_lease_request_and_status_request_encode_as_documented() -> None:
    payload = wire.encode(m.LeaseRequest(run_id="run-1", version=4, max_prompts=16))
    assert payload == _blocks()[0]
    assert len(payload) == int(_after("**LeaseRequest**", r"encodes to (\d+) bytes"))
    assert wire.frame(payload).hex() == _after("The whole frame", r"`([0-9a-f]{20,})`")
    assert wire.frame(wire.encode(m.StatusRequest())).hex() == _after("**StatusRequest**", r"`([0-9a-f]{20,})`")


def test_the_signed_join_request_is_signed_and_verified_as_documented() -> None:
    ident = Identity(bytes(range(32)))
    cap = m.Capability(
        engine="torch",
        device="cpu",
        memory_bytes=8589934592,
        tokens_per_s=100.0,
        price_per_hour=0.0,
        reachable=True,
        listen_addrs=[],
    )
    join = m.JoinRequest(
        run_id="run-1", peer_id=ident.peer_id, capability=cap, version=-1, timestamp=1700000000.0, nonce=bytes(16)
    )
    signed_bytes = wire.canonical_bytes(join)
    assert signed_bytes == _blocks()[1]
    assert len(signed_bytes) == int(_after("**Signed JoinRequest.**", r"signed bytes \((\d+) bytes"))
    assert hashlib.sha256(signed_bytes).hexdigest() == _after("**Signed JoinRequest.**", r"SHA-256 is `([0-9a-f]{64})`")
    signature = _after("**Signed JoinRequest.**", r"signature is\s*`([0-9a-f]{128})`")
    signed = wire.sign(join, ident)
    assert signed.signature.hex() == signature
    documented = join.model_copy(update={"signature": bytes.fromhex(signature)})
    wire.verify(wire.decode(wire.encode(documented)), ident.peer_id)  # what a foreign peer sends verifies


def test_section_5_lists_every_signed_message() -> None:
    section = DOC[DOC.index("## 5. Signatures") : DOC.index("## 6.")]
    listed = set(re.findall(r"`([A-Z][A-Za-z]+)`", section.split("All others", 1)[0]))
    signed = {
        name
        for name, cls in vars(m).items()
        if isinstance(cls, type) and issubclass(cls, m.Message) and cls.__dict__.get("SIGNED") is True
    }
    assert signed and listed == signed
