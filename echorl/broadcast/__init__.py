"""Weight plane: both ends of the log-depth pipelined striped broadcast, side by side.

Imports ``echorl.protocol`` (manifests, chunks, deltas, plans) and ``echorl.net``.

- ``broadcaster.py``: ``Broadcaster`` (learner side: builds a delta or full snapshot, signs the
  manifest and the ``PlanAnnounce``, serves the stripe roots, waits for ``BroadcastDone``),
  ``BroadcastReport``.
- ``members.py``: ``NodeInfo`` (a node as the learner hands it over), ``fit_addrs`` (the
  members' addresses trimmed so the announcement stays one frame).
- ``silence.py``: ``SilentMembers`` (plan members that did not answer the announce or never
  reported: left out of the next 2^k plans).
- ``relay.py``: ``Relay`` (node side: receives chunks from plan parents, verifies each against
  the signed manifest, forwards at once to plan children, rebuilds and applies the version,
  recovers from a stalled parent, catches up).
- ``store.py``: the one store of weight chunks per peer, on disk: ``WeightStore`` (the peer's
  weight files and its bounded ``ChunkCache``), ``VersionState`` (a version's payload file,
  written chunk by chunk as each is verified), ``HeldChain`` (verified versions kept for
  catch-up, the direct fetch and, on the learner, spot checks), ``plan_of``.
- ``files.py``: weight files read and written by offset, the chunk cache, streaming
  verification and deltas applied tensor by tensor from files.
- ``deadlines.py``: every weight-path deadline scaled with bytes and measured bandwidth.
- ``chunk_server.py``: ``ChunkServer`` (chunk streams to children, catch-up and chunk answers,
  all from the store; the weight routes' sender check, download pacing, the direct port's
  tickets). The transports themselves (libp2p streams, direct TCP) are ``net/transport/``.
- ``push.py``: ``Pusher`` / ``PushInbox`` (pushed edges: a parent behind NAT dials its reachable
  child and pushes its stripe).
- ``stripe_feed.py``: ``StripeFeed`` (one stripe into a relay: from its plan parent; if that
  fails, adopted by a live relay or the learner; what is still missing, pulled).
- ``adoption.py``: ``adopters`` (whom an orphan asks, in order: ancestors, uncles with room, a
  stripe head's orphans their earlier siblings, the learner last), ``may_adopt``,
  ``is_nephew``, ``adoption_slots`` (whom a relay streams to off the plan, and how many); the
  simulator (``bench/flowsim.py``) uses the same functions.
- ``recovery.py``: ``recover_stripe`` (a stalled stripe's chunks from other holders),
  ``fetch_payload`` (a caught-up version's payload, chunk by chunk).
- ``relay_process.py``: a bare relay as an OS process (benchmarks and tests).
"""
