"""Receipts a node keeps verify offline, add up, and a forged, altered, torn or copied line does
not count (node/receipts.py, learner/ledger.py)."""

from __future__ import annotations

import base64
import json

import pytest

from echorl.learner.ledger import Ledger
from echorl.node.receipts import ReceiptLog, check, decode_line, verify_file
from echorl.protocol import wire
from echorl.protocol.errors import ErrorCode, ProtocolError
from echorl.protocol.identity import Identity

LEARNER, NODE, MALLORY = Identity.generate(), Identity.generate(), Identity.generate()


def _receipts(n: int) -> list:
    ledger = Ledger(LEARNER, "run-1")
    return [
        wire.sign(ledger.accept(NODE.peer_id, f"L-{i}", 4, 3 + i % 2, 10 * (i + 1), i, i + 1), LEARNER)
        for i in range(n)
    ]


def test_kept_receipts_verify_offline_and_add_up(tmp_path) -> None:
    log = ReceiptLog(tmp_path / "r.jsonl")
    receipts = _receipts(5)
    for r in receipts:
        log.append(r)
    out = verify_file(log.path, LEARNER.peer_id)
    assert not out.refused and out.learners() == {LEARNER.peer_id}
    assert sum(r.groups for r in out.receipts) == sum(r.groups for r in receipts) == 3 + 4 + 3 + 4 + 3
    assert [r.seq for r in out.receipts] == [1, 2, 3, 4, 5]


def test_altered_forged_torn_and_copied_lines_are_refused(tmp_path) -> None:
    good = _receipts(2)
    path = tmp_path / "r.jsonl"
    log = ReceiptLog(path)
    for r in good:
        log.append(r)
    # altered: more groups claimed, the learner's signature kept
    raw = wire.encode(good[0].model_copy(update={"groups": 4, "tokens": 999}))
    altered = json.dumps({"receipt": base64.b64encode(raw).decode()})
    # forged: Mallory signs a receipt that names the real learner
    forged_body = good[1].model_copy(update={"seq": 99, "groups": 4})
    forged = forged_body.model_copy(update={"signature": MALLORY.sign(wire.canonical_bytes(forged_body))})
    # self-signed: Mallory as "learner" of her own receipt
    ledger = Ledger(MALLORY, "run-1")
    self_signed = wire.sign(ledger.accept(NODE.peer_id, "L-x", 8, 8, 80, 0, 1), MALLORY)
    with path.open("a") as f:
        f.write(altered + "\n")
        f.write(json.dumps({"receipt": base64.b64encode(wire.encode(forged)).decode()}) + "\n")
        f.write(json.dumps({"receipt": base64.b64encode(wire.encode(self_signed)).decode()}) + "\n")
        f.write(path.read_text().splitlines()[0] + "\n")  # a copy of a good line
        f.write('{"receipt": "not base64!"}\n{"recei')  # garbage and a torn last line
    pinned = verify_file(path, LEARNER.peer_id)
    assert [r.seq for r in pinned.receipts] == [1, 2]
    reasons = [why for _, why in pinned.refused]
    assert [n for n, _ in pinned.refused] == [3, 4, 5, 6, 7, 8]
    assert reasons[0].startswith("bad_signature") and reasons[1].startswith("bad_signature")
    assert reasons[2].startswith("wrong_signer") and "duplicate" in reasons[3]
    assert reasons[4].startswith("malformed") and reasons[5].startswith("malformed")
    unpinned = verify_file(path)  # the self-signed one verifies, but shows up as another learner
    assert unpinned.learners() == {LEARNER.peer_id, MALLORY.peer_id}
    assert sum(r.groups for r in unpinned.receipts if r.learner_peer_id == LEARNER.peer_id) == 3 + 4


def test_a_node_refuses_a_receipt_for_someone_else() -> None:
    r = _receipts(1)[0]
    check(r, LEARNER.peer_id, NODE.peer_id, "run-1", "L-0")
    for kwargs in ({"peer_id": MALLORY.peer_id}, {"run_id": "run-2"}, {"lease_id": "L-9"}):
        with pytest.raises(ProtocolError) as err:
            check(r, LEARNER.peer_id, **kwargs)
        assert err.value.code is ErrorCode.SCHEMA
    with pytest.raises(ProtocolError):
        decode_line(b"x" * 5000)


def test_ledger_counts_a_lease_once_across_files_per_run_and_needs_a_pinned_learner(tmp_path, capsys) -> None:
    """Issue 24, finding 6: ``echorl ledger --receipts`` counted a receipt copied into a second
    file twice, mixed runs into one row, and summed a file a made-up learner signed for itself
    (exit 0) when no ``--learner-id`` was given."""
    import argparse

    from echorl.cli import ledger as cli

    receipts = _receipts(3)
    other_run = wire.sign(Ledger(LEARNER, "run-2").accept(NODE.peer_id, "L-0", 4, 4, 40, 0, 1), LEARNER)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for r in receipts:
        ReceiptLog(a).append(r)
    ReceiptLog(b).append(receipts[0])  # the same receipt, kept twice
    ReceiptLog(b).append(other_run)
    rows, refused, learners = cli.from_receipts([str(a), str(b)], LEARNER.peer_id)
    by_run = {r["run"]: r for r in rows}
    assert set(by_run) == {"run-1", "run-2"} and learners == {LEARNER.peer_id}
    assert by_run["run-1"]["groups_accepted"] == sum(r.groups for r in receipts)  # not + receipts[0]'s again
    assert by_run["run-1"]["submissions_accepted"] == 3 and by_run["run-2"]["groups_accepted"] == 4
    assert len(refused) == 1 and refused[0].startswith(f"{b}:1: duplicate of {a}:1")

    mallory = tmp_path / "m.jsonl"
    ReceiptLog(mallory).append(wire.sign(Ledger(MALLORY, "run-1").accept(NODE.peer_id, "L-x", 8, 8, 80, 0, 1), MALLORY))
    args = argparse.Namespace(receipts=[str(mallory)], learner_id=None, csv=None, json=True, bootstrap=None)
    assert cli.run(args) == 2 and "--learner-id" in capsys.readouterr().err
    args.learner_id = LEARNER.peer_id
    assert cli.run(args) == 1  # refused: not signed by the pinned learner
    args.receipts = [str(a), str(b)]
    assert cli.run(args) == 1 and "duplicate" in capsys.readouterr().out
