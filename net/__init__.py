"""Network plane: the only code that talks to py-libp2p and raw sockets.

Imports ``echorl.protocol`` and nothing else of echorl; the learner, the node and the broadcast
sit on it.

- ``host.py``: ``Host`` (one libp2p host: routes with request caps, rate limits and deadlines,
  pooled request streams), ``HostConfig``, ``open_host``, ``RemoteError``, ``PeerUnavailable``.
- ``routes.py``: the per-peer rate limit of each stream id (ids, request types and caps are the
  protocol's: ``protocol/routes.py``; ``Host.serve`` registers a handler table against both).
- ``framing.py``: length-prefixed frames with deadlines (``read_frame``, ``write_frame``).
- ``ratelimit.py``: ``RateLimit``, ``TokenBuckets`` (per-peer token buckets, bounded memory).
- ``transport.py``: ``UploadLimiter`` (one upload cap per process), chunk transports over
  libp2p and the ticketed direct TCP path, ``serve_raw``.
- ``membership.py``: ``Membership`` (Kademlia DHT, the signed learner record), ``find_learner``.
"""
