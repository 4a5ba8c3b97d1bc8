"""The basement every role may import; it imports no other echorl package and no torch at import.

- ``config.py``: ``Section`` (typed settings → flags, TOML ``--config``, ``--print-config``),
  ``ModelFields``, ``PeerFields``, ``ConfigError``.
- ``atomic.py``: crash-safe writes (temporary file, fsync, rename).
- ``metrics_sinks.py``: where a metrics row goes besides JSONL (Prometheus ``/metrics``,
  TensorBoard).
- ``gc_pauses.py``: ``after_start_up`` (each long-running role freezes what start-up built, so
  full garbage collections do not stop its event loop for most of a second).
"""
