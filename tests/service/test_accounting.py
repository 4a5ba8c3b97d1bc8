"""Per-session accounting of ``echorl serve`` (service/accounting.py): the metrics row holds each
live session's and each user's usage, and the per-user totals outlive the sessions."""

from __future__ import annotations

from echorl.service.accounting import usage_row
from echorl.service.sessions import SessionBook


def test_usage_row_by_session_and_user_and_totals_outlive_sessions():
    book = SessionBook(max_sessions=8, max_models=1, max_samplers=1, ttl_s=60.0, price_per_hour=3600.0)
    a1, a2, b = book.create("alice"), book.create("alice"), book.create("bob")
    book.charge(a1, 1.0, sampled=10)
    book.charge(a2, 2.0, trained=7)
    book.charge(b, 0.5, sampled=3, forward=4)
    row = usage_row(book)
    assert row["sessions_live"] == 3 and row["requests"] == 3
    assert row["tokens_sampled"] == 13 and row["tokens_trained"] == 7 and row["tokens_forward"] == 4
    assert row["session_tokens_sampled"] == {a1.ident: 10, a2.ident: 0, b.ident: 3}
    assert row["user_tokens_trained"] == {"alice": 7, "bob": 0}
    assert row["user_cost"] == {"alice": 3.0, "bob": 0.5}  # compute hours x price
    a1.finished = True
    assert [s.ident for s in book.expired()] == [a1.ident]
    row = usage_row(book)
    assert a1.ident not in row["session_requests"] and row["user_tokens_sampled"]["alice"] == 10
    assert row["tokens_sampled"] == 13 and row["sessions_live"] == 2
