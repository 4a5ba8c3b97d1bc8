"""What a volunteer runs: the ``echorl node`` daemon.

Imports ``echorl.protocol``, ``echorl.net``, ``echorl.broadcast``, ``echorl.actor`` and
``echorl.tasks``; never ``echorl.learner`` (the learner is a remote peer, known only by its
pinned peer id).

- ``config.py``: ``NodeConfig`` (the typed settings; flags are built from it).
- ``daemon.py``: ``echorl node``: pre-flight checks (addresses, model, key), start-up, signals.
- ``session.py``: the conversation with the learner: join, lease, back-off, ``NodeExit``.
- ``rollouts.py``: one lease's work: backend, capability record, generate → signed submit → receipt.
- ``progress.py``: ``NodeState`` (the node's run, lease, weights and metrics counters).
- ``versions.py``: ``NodeWeights`` (receive versions through the broadcast ``Relay``, catch up or
  fetch directly when behind, load each verified version into the inference backend).
- ``adapters.py``: ``NodeAdapters`` (LoRA runs: each adapter version applied over the node's own
  base, checked by digest; another base ends the node in one line).
- ``state.py``: ``SnapshotKeeper`` (the newest verified snapshot on disk; a restarted node
  resumes from it and serves it to peers catching up).
"""
