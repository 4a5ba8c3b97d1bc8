"""Test double: a malicious relay process that alters every chunk it forwards to its plan
children (one byte flipped in the chunk's data), on libp2p streams and the direct TCP path alike.

    python tests/broadcast/tampering_relay.py --learner MULTIADDR --run-id RUN ...   # relay_process flags
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from echorl.broadcast import relay_process
from echorl.broadcast.relay import Relay
from echorl.broadcast.store import VersionState
from echorl.net.transport import ChunkStream
from echorl.protocol import wire
from echorl.protocol.messages import Chunk


def tampered(body: bytes) -> bytes:
    """The same ``Chunk`` frame with one byte of its data flipped (the digest left as it was)."""
    msg = wire.decode(body, expect=Chunk)
    assert isinstance(msg, Chunk)
    data = bytearray(msg.data)
    data[len(data) // 2] ^= 0xFF
    return wire.encode(Chunk(digest=msg.digest, data=bytes(data)))


class TamperingStream(ChunkStream):
    """A chunk stream (libp2p or direct TCP) that alters every frame sent on it."""

    def __init__(self, inner: ChunkStream) -> None:
        self.inner = inner
        self.io_timeout = inner.io_timeout

    def frames(self, first_byte_timeout: float, frame_timeout: float | None = None) -> AsyncIterator[bytes]:
        return self.inner.frames(first_byte_timeout, frame_timeout)

    async def send(self, frame_body: bytes) -> None:
        await self.inner.send(tampered(frame_body))

    async def close(self) -> None:
        await self.inner.close()

    async def aclose(self) -> None:
        await self.inner.aclose()


class TamperingRelay(Relay):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        serve = self.server.serve_stripe

        async def serve_tampered(stream: ChunkStream, state: VersionState, stripe: int, skip: int = 0) -> None:
            await serve(TamperingStream(stream), state, stripe, skip)

        self.server.serve_stripe = serve_tampered  # type: ignore[method-assign]


if __name__ == "__main__":
    relay_process.main(relay_class=TamperingRelay)
