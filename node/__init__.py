"""What a volunteer runs: the ``echorl node`` daemon.

Imports ``echorl.protocol``, ``echorl.net``, ``echorl.broadcast``, ``echorl.actor`` and
``echorl.tasks``; never ``echorl.learner`` (the learner is a remote peer, known only by its
pinned peer id).

- ``config.py``: ``NodeConfig`` (the typed settings; flags are built from it).
- ``daemon.py``: ``echorl node``: join, lease → generate → signed submit, retry with back-off.
- ``versions.py``: ``NodeWeights`` (receive versions through the broadcast ``Relay``, catch up or
  fetch directly when behind, load each verified version into the inference backend).
- ``state.py``: ``SnapshotKeeper`` (the newest verified snapshot on disk; a restarted node
  resumes from it and serves it to peers catching up).
"""
