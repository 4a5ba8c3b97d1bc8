"""Garbage-collector settings for a long-running role, so that its event loop does not stand still.

CPython's cyclic collector stops the whole process (the trio loop and every worker thread) while it
scans; a full (oldest-generation) collection scans every tracked object. Measured at 1,000 peers
(issue 27, ``bench/swarm.py --peers 1000 --learner-core 0``, a ``gc.callbacks`` probe): the learner
tracked ~460,000 objects from start-up alone (torch, transformers, the model's modules: functions,
tuples, types) plus ~600 per joined peer, and ran a full collection 24 times in ~100 s at
0.65-0.78 s each, finding nothing to free in most. Every request in flight waited: the lease
latency's 99th percentile (1.2-1.7 s with the learner on a core of its own) was these pauses.

``after_start_up`` is called once a role has loaded what it keeps for its lifetime:

- ``gc.freeze()`` moves every object alive then out of the collector's reach (they are still freed
  by reference counting; a frozen cycle is never collected, which start-up's modules and model are
  not meant to be);
- a larger first-generation threshold (``GEN0_THRESHOLD``) lets the short-lived objects of each
  request (messages, frames, dicts) die by reference counting before a young collection would
  promote them toward the generation that full collections scan.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 20_000
"""Allocations net of frees between young collections (CPython's default: 700). A lease request or
a submission allocates hundreds to thousands of tracked objects that live until it is answered; at
700 young collections ran inside each one and promoted its objects, so full collections came back
even with start-up frozen: 28 in ~100 s at 0.42-0.51 s each at 1,000 peers, the learner's loop lag
p99 379 ms. At 20,000 at most one ran in a run (0.28 s); a young collection took 20-115 ms there
(probably its objects' referents, spread over the learner's heap), loop lag p99 90-103 ms
(``docs/network-notes.md``, "Lease latency at 1,000 peers")."""


def after_start_up() -> None:
    """Freeze what start-up built and raise the young generation's threshold (module docstring).
    Call once, after the model, task and host are loaded and before serving."""
    gc.collect()  # start-up's garbage goes now, not frozen with the rest
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])  # the older generations: CPython's
