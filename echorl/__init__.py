"""echorl: decentralized RL post-training of language models (the Echo-2 design) over py-libp2p.

The planes live in top-level folders mapped into this package: ``echorl.protocol`` (wire
contract, no I/O), ``echorl.node`` (network), ``echorl.actor`` (rollouts), ``echorl.learner``
(GRPO, staleness, checkpoints) and ``echorl.tasks`` (prompt sources and verifiers).
"""

__version__ = "0.1.0"
