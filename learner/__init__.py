"""Everything the learner peer runs, beside the RL core that also runs without a network.

RL core (no network): ``grpo.py`` (``GRPOTrainer``, ``GRPOConfig``: the clipped GRPO loss on
per-token behaviour log-probs), ``buffer.py`` (``StalenessBuffer``: accepts a rollout group only
if t − b ≤ S, scores it off the event loop), ``checkpoint.py`` (atomic checkpoints: model,
optimizer, version, RNG, task cursor; ``extra`` holds each component's ``state_dict``),
``loop.py`` (``TrainingLoop``: the one training loop — κ, leasable version, evaluation,
metrics row, checkpoints — fed by a rollout source), ``local.py`` (``echorl train-local``: that
loop fed by actor worker processes, no network), ``distributed.py`` (``DistributedGRPO``: the
GRPO step data-parallel over ``--nproc`` ranks, same interface).

The learner peer (``echorl learner``): ``config.py`` (``LearnerConfig``, ``TrainLocalConfig``: the
typed settings), ``peer.py`` (startup wiring),
``service.py`` (``LearnerService``: join, lease, submit, return and status handlers, where
untrusted input is checked), ``admission.py`` (what a node's input must be beyond the schema;
lease limits, deadlines, back-off), ``policing.py`` (refusing, flagging, banning a peer),
``membership.py`` (one live process per key, dial-back reachability, the signed run end),
``ledger.py`` (signed receipts, rejections by reason, cost), ``replay.py`` (multi-turn episodes
replayed from the environment seed), ``leases.py`` (``LeaseBook``, ``LeasePolicy``),
``activation.py`` (cost-aware choice of active nodes), ``spot_check.py`` (``SpotChecker``:
re-scores submitted log-probs) with ``tolerances.py`` (per engine and dtype), ``train.py`` (the
loop fed by network rollouts: ``NetworkSource``, provisioning rule),
``publish.py`` (``Publisher``: broadcasting a version overlaps training), ``resume.py`` (what a
checkpoint keeps of the network side: bans, node addresses).

Imports ``protocol``, ``net``, ``broadcast``, ``actor`` and ``tasks``; never ``echorl.node``.
"""
