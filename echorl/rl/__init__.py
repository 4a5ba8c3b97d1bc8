"""The RL core: GRPO training without a network, shared by ``echorl train-local`` and the learner peer.

- ``grpo.py``: ``GRPOTrainer``, ``GRPOConfig`` (the clipped GRPO loss on per-token behaviour
  log-probs).
- ``buffer.py``: ``StalenessBuffer`` (accepts a rollout group only if t − b ≤ S; scores it off
  the event loop).
- ``loop.py``: ``TrainingLoop`` (the one training loop: κ, leasable version, evaluation,
  metrics row, checkpoints), fed by a ``RolloutSource``.
- ``checkpoint.py``: atomic checkpoints (model, optimizer, version, RNG, task cursor; ``extra``
  holds each component's ``state_dict``).
- ``replay.py``: multi-turn episodes replayed from (environment seed, the model's actions).
- ``distributed.py``: ``DistributedGRPO`` (the GRPO step data-parallel over ``--nproc`` ranks,
  same interface; a lost worker is a ``DistributedError``), with ``collectives.py`` (what the
  ranks exchange besides gradients, as tensors: nothing pickled).
- ``seams.py``: ``Tokenizer``, ``Trainer``, ``MetricsSink`` (the Protocols at the core's seams).
- ``staleness.py``: ``StalenessRule`` (every rule the bound S implies: the accept test t − b ≤ S,
  κ, the version lag, the oldest leasable version, the in-flight bound).
- ``build.py``: ``build_loop`` (the one builder of the loop, trainer and buffer from a run's
  settings, used by train-local and the learner peer), ``loop_settings``, ``grpo_config``.
- ``local.py``: ``echorl train-local`` (the loop fed by actor worker processes, no network).
- ``config.py``: ``TrainingFields``, ``TrainLocalConfig`` (the typed settings of a run: every
  training setting is a ``TrainingFields`` field, so both commands have it as a flag).

Imports ``protocol``, ``tasks``, ``actor`` and ``common``; never the network (``net``,
``broadcast``, ``learner``, ``node``).
"""
