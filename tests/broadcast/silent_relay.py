"""Test double: a relay that takes every announcement but forwards none to its stripe-0 children
(the adversary of the announcement sent down the plan, ``broadcast/announcing.py``).

    python tests/broadcast/silent_relay.py --learner MULTIADDR --run-id RUN ...   # relay_process flags
"""

from __future__ import annotations

from echorl.broadcast import relay_process
from echorl.broadcast.relay import Relay


class SilentRelay(Relay):
    async def _forward(self, version: int, children: list[str], encoded: bytes) -> None:
        return None  # takes it, relays chunks as planned, passes no announcement on


if __name__ == "__main__":
    relay_process.main(relay_class=SilentRelay)
