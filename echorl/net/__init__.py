"""Network plane: the only code that talks to py-libp2p and raw sockets.

Imports ``echorl.protocol`` and nothing else of echorl; the learner, the node and the broadcast
sit on it.

- ``host.py``: ``Host`` (one libp2p host: addresses and dialing, pooled request streams,
  ``request``, ``ping``), ``HostConfig``, ``open_host``, ``RemoteError``, ``PeerUnavailable``.
- ``serving.py``: ``RouteServer`` (the routes a ``Host`` serves: request caps, rate limits,
  deadlines, the sender check ``admit`` before any body is read, strikes), ``RequestContext``.
- ``routes.py``: the per-peer rate limit of each stream id (ids, request types and caps are the
  protocol's: ``protocol/routes.py``; ``Host.serve`` registers a handler table against both).
- ``framing.py``: length-prefixed frames with deadlines (``read_frame``, ``write_frame``).
- ``ratelimit.py``: ``RateLimit``, ``TokenBuckets`` (per-peer token buckets, bounded memory).
- ``guard.py``: ``ConnectionGuard`` (inbound connections per address), ``RefusalStrikes``.
- ``hostkey.py``: ``ip_key``, ``same_host`` (what one host counts as: IPv4 address, IPv6 /64).
- ``transport/``: chunk transports side by side (the ``ChunkTransport`` interface, libp2p
  streams, the ticketed direct TCP path and its listener, ``ChunkDialer``: the one place the
  path is picked; ``UploadLimiter``): see its package doc.
- ``dialback.py``: ``dial_back`` (is a peer reachable at an address it advertises?).
- ``addrs.py``: multiaddr parsing, advertised addresses, dial-failure reasons.
- ``membership.py``: ``Membership`` (Kademlia DHT, the signed learner record), ``find_learner``.
"""
