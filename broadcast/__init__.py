"""Weight plane: both ends of the log-depth pipelined striped broadcast, side by side.

Imports ``echorl.protocol`` (manifests, chunks, deltas, plans) and ``echorl.net``.

- ``broadcaster.py``: ``Broadcaster`` (learner side: builds a delta or full snapshot, signs the
  manifest and the ``PlanAnnounce``, serves the stripe roots, waits for ``BroadcastDone``),
  ``NodeInfo``, ``BroadcastReport``.
- ``relay.py``: ``Relay`` (node side: receives chunks from plan parents, verifies each against
  the signed manifest, forwards at once to plan children, rebuilds and applies the version,
  recovers from a stalled parent, catches up).
- ``store.py``: the one store of weight chunks per peer: ``VersionState`` (a version's chunks as
  they are verified, each held once as the frame body that is forwarded), ``HeldChain`` (verified
  versions kept for catch-up, the direct fetch and, on the learner, spot checks), ``plan_of``.
- ``chunk_server.py``: ``ChunkServer`` (chunk streams to children, catch-up and chunk answers,
  all from the store).
- ``relay_process.py``: a bare relay as an OS process (benchmarks and tests).
"""
