"""Plan members that stay silent: the record that keeps them out of the next plans.

A member that did not answer a version's announce, or answered it and never reported the version
done, costs that publication a bounded wait (``broadcast/broadcaster.py``); so it sits out the
next 2^k plans, k its misses in a row (at most ``MAX_SILENT_DOUBLINGS``), and fetches versions by
catch-up meanwhile. A member that has never reported any version sits out 2^6 at its first miss:
a silent newcomer has no record that would earn it the doubling. A report clears the record.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

log = logging.getLogger("echorl.broadcast.broadcaster")

MAX_SILENT_DOUBLINGS = 6  # a silent member sits out at most 2^6 plans in a row
MAX_REMEMBERED_REPORTERS = 65_536


class SilentMembers:
    """Misses in a row and the publication until which each silent member is left out; which
    members ever reported (LRU-bounded). Publications are counted by the broadcaster."""

    def __init__(self) -> None:
        self._silent: dict[str, tuple[int, int]] = {}  # member -> (misses in a row, out until publication)
        self._reported: OrderedDict[str, None] = OrderedDict()

    def benched(self, peer_id: str, publication: int) -> bool:
        """Whether ``peer_id`` sits out the plan of publication number ``publication``."""
        return self._silent.get(peer_id, (0, -1))[1] >= publication

    def note(self, version: int, silent: set[str], reported: set[str], publication: int) -> None:
        """After publication number ``publication`` (of ``version``): ``reported`` members clear
        their record, ``silent`` ones sit out the next 2^k plans."""
        for p in reported:
            self._silent.pop(p, None)
            self._reported[p] = None
            self._reported.move_to_end(p)
        while len(self._reported) > MAX_REMEMBERED_REPORTERS:
            self._reported.popitem(last=False)
        for p in silent:
            misses = self._silent.get(p, (0, 0))[0] + 1 if p in self._reported else MAX_SILENT_DOUBLINGS
            out = 2 ** min(misses, MAX_SILENT_DOUBLINGS)
            self._silent[p] = (misses, publication + out - 1)
            log.info("v%d: %s never reported done; left out of the next %d plans", version, p[:16], out)

    def clear(self) -> None:
        """Forget every silent member's record (each is in the next plan again)."""
        self._silent.clear()
