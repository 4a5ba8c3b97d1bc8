"""Test double: a malicious relay process that alters every chunk it forwards to its plan
children (one byte flipped in the chunk's data), on libp2p streams and the direct TCP path alike.

    python tests/broadcast/tampering_relay.py --learner MULTIADDR --run-id RUN ...   # relay_process flags
"""

from __future__ import annotations

from typing import Any

from echorl.broadcast import relay_process
from echorl.broadcast.relay import Relay
from echorl.net.transport import Libp2pTransport
from echorl.protocol import wire
from echorl.protocol.messages import Chunk


def tampered(body: bytes) -> bytes:
    """The same ``Chunk`` frame with one byte of its data flipped (the digest left as it was)."""
    msg = wire.decode(body, expect=Chunk)
    assert isinstance(msg, Chunk)
    data = bytearray(msg.data)
    data[len(data) // 2] ^= 0xFF
    return wire.encode(Chunk(digest=msg.digest, data=bytes(data)))


class TamperingTransport(Libp2pTransport):
    async def send(self, sink: Any, frame_body: bytes) -> None:
        await super().send(sink, tampered(frame_body))


class TamperingRelay(Relay):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        t = self.server.transport
        self.server.transport = TamperingTransport(t.host, t.protocol, t.limiter, io_timeout=t.io_timeout)


if __name__ == "__main__":
    relay_process.main(relay_class=TamperingRelay)
