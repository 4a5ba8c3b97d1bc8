"""Weight plane: both ends of the log-depth pipelined striped broadcast, side by side.

Imports ``echorl.protocol`` (manifests, chunks, deltas, plans) and ``echorl.net``.

- ``broadcaster.py``: ``Broadcaster`` (learner side: builds a delta or full snapshot, signs the
  manifest and the ``PlanAnnounce``, serves the stripe roots, waits for ``BroadcastDone``),
  ``NodeInfo``, ``BroadcastReport``.
- ``relay.py``: ``Relay`` (node side: receives chunks from plan parents, verifies each against
  the signed manifest, forwards at once to plan children, rebuilds and applies the version,
  recovers from a stalled parent, catches up).
- ``chunk_server.py``: the shared core: stream ids of the broadcast routes, ``VersionState``
  (a version's chunks as they are verified), ``ChunkServer`` (chunk streams to children,
  catch-up and chunk answers).
- ``weight_store.py``: ``WeightStore`` (the learner's last S+1 published versions, for direct
  fetch and spot checks) and ``fetch_weights_bytes`` (a node's fallback pull).
- ``relay_process.py``: a bare relay as an OS process (benchmarks and tests).
"""
