"""Futures (the Tinker API's "request ids") and the one worker that computes them in order.

Every training and sampling call returns at once with a ``request_id``; the client then polls
``/api/v1/retrieve_future`` until the result is there (tinker ``lib/api_future_impl.py``: a
``{"type": "try_again"}`` answer makes it poll again). :class:`FutureBook` keeps each future's
owner, state and result; a poll waits for the result at most ``poll_wait_s`` (a long poll: no
busy loop, no hang past the client's 45 s read timeout). Finished results are kept
``keep_s`` and the book holds at most ``max_futures``; the oldest finished go first.

:class:`Worker` runs jobs one at a time off the event loop (``trio.to_thread``), in the order
they were accepted: a training client's ``forward_backward`` then ``optim_step`` apply in order,
as the protocol's ``seq_id`` promises. Its queue is bounded; a full queue is a 429 (the client
backs off and retries).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

log = logging.getLogger(__name__)


class UserError(ValueError):
    """A job failed because of what the request asked (category ``user``), one line."""


@dataclass
class Future:
    ident: str
    owner: str  # user (key owner) allowed to read it
    kind: str  # what the result is: "json", "fwdbwd", "sample"
    created: float
    done: trio.Event = field(default_factory=trio.Event)
    finished: float = 0.0
    result: Any = None
    error: str | None = None
    category: str = "server"
    model_id: str | None = None


class FutureBook:
    def __init__(self, max_futures: int, keep_s: float, poll_wait_s: float) -> None:
        self.max_futures = max_futures
        self.keep_s = keep_s
        self.poll_wait_s = poll_wait_s
        self.futures: dict[str, Future] = {}

    def create(self, owner: str, kind: str, model_id: str | None = None) -> Future:
        self._trim()
        if len(self.futures) >= self.max_futures:
            raise OverflowError("too many requests in flight")
        fut = Future(
            ident=f"r-{secrets.token_hex(10)}", owner=owner, kind=kind, created=time.monotonic(), model_id=model_id
        )
        self.futures[fut.ident] = fut
        return fut

    def _trim(self) -> None:
        now = time.monotonic()
        for ident in [i for i, f in self.futures.items() if f.done.is_set() and now - f.finished > self.keep_s]:
            del self.futures[ident]
        if len(self.futures) >= self.max_futures:
            done = sorted((f.finished, i) for i, f in self.futures.items() if f.done.is_set())
            for _, ident in done[: len(self.futures) - self.max_futures + 1]:
                del self.futures[ident]

    def get(self, owner: str, ident: str) -> Future | None:
        fut = self.futures.get(ident)
        return fut if fut is not None and fut.owner == owner else None

    async def wait(self, fut: Future) -> bool:
        """True once the future is finished; False after ``poll_wait_s`` (the client polls again)."""
        with trio.move_on_after(self.poll_wait_s):
            await fut.done.wait()
        return fut.done.is_set()

    @staticmethod
    def finish(fut: Future, result: Any = None, error: str | None = None, category: str = "server") -> None:
        fut.result, fut.error, fut.category = result, error, category
        fut.finished = time.monotonic()
        fut.done.set()


@dataclass
class Job:
    future: Future
    run: Callable[[], Any]
    """Runs in the worker thread; returns the result (or raises)."""
    after: Callable[[Any, float], None] | None = None
    """Runs on the event loop with the result and the seconds ``run`` took (accounting)."""


class Worker:
    """One queue, one consumer, compute in a thread: the order jobs were accepted is the order they run."""

    def __init__(self, queue_size: int, user_errors: tuple[type[BaseException], ...]) -> None:
        self._send, self._recv = trio.open_memory_channel[Job](queue_size)
        self.user_errors = user_errors
        self.busy_s = 0.0
        self.jobs_done = 0

    def submit(self, job: Job) -> None:
        try:
            self._send.send_nowait(job)
        except trio.WouldBlock:
            FutureBook.finish(job.future, error="server queue full", category="server")
            raise OverflowError("the server's queue is full; retry shortly") from None

    async def run(self) -> None:
        async for job in self._recv:
            t0 = time.perf_counter()
            try:
                result = await trio.to_thread.run_sync(job.run)
            except self.user_errors as exc:
                FutureBook.finish(job.future, error=str(exc), category="user")
                continue
            except Exception as exc:  # a bug or resource failure: the process stays up
                log.exception("job %s failed", job.future.ident)
                FutureBook.finish(job.future, error=f"{type(exc).__name__}: {exc}", category="server")
                continue
            seconds = time.perf_counter() - t0
            self.busy_s += seconds
            self.jobs_done += 1
            if job.after is not None:
                job.after(result, seconds)
            FutureBook.finish(job.future, result=result)
