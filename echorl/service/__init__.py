"""RL as a service: ``echorl serve`` speaks the Tinker API (the ``tinker`` and ``logits-sdk`` clients).

A client creates LoRA training clients on the base model the server holds, runs ``forward`` /
``forward_backward`` with the built-in losses and ``optim_step``, saves weights for sampling and
samples, all through futures it polls. What each file holds:

- ``serve.py``: ``echorl serve`` (startup, the trio loop: endpoint, worker, session reaper).
- ``config.py``: ``ServeConfig`` (its flags).
- ``http.py``: ``App`` (routes, API-key check, bounded bodies, errors as one line).
- ``api.py``: ``Api`` (each endpoint's operation; ``echorl://`` checkpoint paths).
- ``engine.py``: ``Engine`` (the base model with one peft LoRA adapter per training client;
  snapshots for samplers; sampling with the torch engine).
- ``losses.py``: ``cross_entropy``, ``importance_sampling``, ``ppo`` per token.
- ``futures.py``: ``FutureBook`` (request ids, long-poll retrieval), ``Worker`` (jobs in order).
- ``sessions.py``: API keys, ``SessionBook`` (ownership, heartbeats, expiry, per-session usage).
- ``swarm.py``: ``Swarm`` (``--swarm``: the learner peer; snapshots published as adapter versions,
  sampling requests leased to nodes under the learner's checks, a bounded wait, then the server).
- ``wire.py``: request decoding (JSON and protobuf) and result encoding; ``proto.py``: the
  protobuf messages, declared in code.

Imports ``actor``, ``rl``, ``net``, ``common``, and with ``--swarm`` ``learner``, ``broadcast`` and ``protocol``.
"""
