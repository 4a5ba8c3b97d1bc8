"""Chunk transports, side by side: how a stripe's ``Chunk`` frames travel between two peers.

- ``base.py``: the interface, ``ChunkTransport`` (``open(peer, subscribe)``) and ``ChunkStream``
  (``frames``, ``send``, ``close``, ``aclose``); ``FramedStream``, the frames over any byte stream.
- ``libp2p_streams.py``: ``Libp2pTransport`` (streams over libp2p: works through NAT) and
  ``serve_raw`` (the serving end of a raw chunk-stream route).
- ``direct_tcp.py``: the ticketed direct TCP path: ``DirectTransport`` (dials only the IP of the
  authenticated libp2p connection, sends a ticket proof), ``TicketBook``, ``DirectListener``
  (the direct port: a listener that takes a handler), ``TcpStreamAdapter``, ``ticket_proof``.
- ``paths.py``: ``ChunkDialer`` (the one place the path to a peer is picked), ``PULL``/``PUSHED``.
- ``pacing.py``: ``UploadLimiter`` (one upload cap per process), ``write_paced``.

A new transport is one file here implementing ``ChunkTransport`` and one line in
``ChunkDialer.paths``; the broadcast (``echorl/broadcast``) only sees ``ChunkStream``.
"""

from echorl.net.transport.base import MAX_CHUNK_FRAME, ChunkStream, ChunkTransport, FramedStream
from echorl.net.transport.direct_tcp import (
    DirectListener,
    DirectTransport,
    TcpStreamAdapter,
    TicketBook,
    listen_ip,
    ticket_proof,
)
from echorl.net.transport.libp2p_streams import Libp2pTransport, serve_raw
from echorl.net.transport.pacing import UploadLimiter, slice_bytes_for, write_paced
from echorl.net.transport.paths import PULL, PUSHED, ChunkDialer, Edge

__all__ = [
    "MAX_CHUNK_FRAME",
    "PULL",
    "PUSHED",
    "ChunkDialer",
    "ChunkStream",
    "ChunkTransport",
    "DirectListener",
    "DirectTransport",
    "Edge",
    "FramedStream",
    "Libp2pTransport",
    "TcpStreamAdapter",
    "TicketBook",
    "UploadLimiter",
    "listen_ip",
    "serve_raw",
    "slice_bytes_for",
    "ticket_proof",
    "write_paced",
]
