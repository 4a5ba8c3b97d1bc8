"""Network policy per stream id: the per-peer rate limit of each route a peer serves.

The ids, request types and size caps are the protocol's (``echorl.protocol.routes``).
"""

from __future__ import annotations

from echorl.net.ratelimit import RateLimit
from echorl.protocol import routes as ids

RATES: dict[str, RateLimit] = {
    ids.JOIN: RateLimit(1.0, 10.0),
    ids.LEASE: RateLimit(50.0, 100.0),
    ids.SUBMIT: RateLimit(50.0, 100.0),
    ids.RETURN: RateLimit(5.0, 20.0),
    ids.STATUS: RateLimit(10.0, 30.0),
    ids.DIALBACK: RateLimit(0.5, 3.0),
    ids.ANNOUNCE: RateLimit(20.0, 50.0),
    ids.CHUNK: RateLimit(2000.0, 4000.0),
    ids.CATCHUP: RateLimit(10.0, 30.0),
    ids.DONE: RateLimit(50.0, 200.0),
    ids.HEARD: RateLimit(50.0, 200.0),
    ids.TICKET: RateLimit(50.0, 200.0),
    ids.PUSH: RateLimit(50.0, 200.0),
}
