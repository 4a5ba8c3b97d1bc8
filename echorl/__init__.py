"""echorl: decentralized RL post-training of language models (the Echo-2 design) over py-libp2p.

Every package is a folder here and its import path (docs/architecture.md §1 draws the layers):

| package | what lives there |
|---|---|
| ``echorl.protocol`` | the wire contract: messages, signatures, snapshots, deltas, plans (no I/O) |
| ``echorl.net`` | the only code that touches py-libp2p and sockets: hosts, framing, transports, DHT |
| ``echorl.broadcast`` | both ends of the weight path: broadcaster, relay, store, deadlines |
| ``echorl.actor`` | inference engines and sampling with behaviour log-probs |
| ``echorl.tasks`` | prompt sources, verifiers and multi-turn environments |
| ``echorl.rl`` | the RL core without a network: GRPO, buffer, loop, checkpoints, staleness rules |
| ``echorl.learner`` | the learner peer: handlers, peer book, submission checks, publication |
| ``echorl.node`` | the volunteer's node daemon |
| ``echorl.common`` | the basement: settings machinery, crash-safe writes, metrics sinks |
| ``echorl.cli`` | the command-line roof (``echorl …``): imported by nothing |
"""

__version__ = "0.1.0"
