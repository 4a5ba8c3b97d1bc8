"""Everything the learner peer runs, beside the RL core that also runs without a network.

RL core (no network): ``grpo.py`` (``GRPOTrainer``, ``GRPOConfig``: the clipped GRPO loss on
per-token behaviour log-probs), ``buffer.py`` (``StalenessBuffer``: accepts a rollout group only
if t − b ≤ S, scores it off the event loop), ``checkpoint.py`` (atomic checkpoints: model,
optimizer, version, RNG, task cursor, pending prompts), ``local.py`` (``echorl train-local``:
the same GRPO with actor worker processes and no network), ``distributed.py``
(``DistributedGRPO``: the GRPO step data-parallel over ``--nproc`` ranks, the same interface).

The learner peer (``echorl learner``): ``config.py`` (``LearnerConfig``, ``TrainLocalConfig``: the
typed settings), ``peer.py`` (startup wiring),
``service.py`` (``LearnerService``: join, lease, submit, return and status handlers, where
untrusted input is checked), ``leases.py`` (``LeaseBook``), ``activation.py`` (cost-aware choice
of active nodes), ``spot_check.py`` (``SpotChecker``: re-scores submitted log-probs),
``train.py`` (``Trainer``: the GRPO loop over network rollouts, metrics, provisioning rule),
``publish.py`` (``Publisher``: broadcasting a version overlaps training), ``resume.py`` (what a
checkpoint keeps of the network side: bans, node addresses).

Imports ``protocol``, ``net``, ``broadcast``, ``actor`` and ``tasks``; never ``echorl.node``.
"""
