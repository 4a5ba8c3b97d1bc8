"""Contract plane: wire messages, identity and signatures, snapshots, deltas, broadcast plans.

Pure functions and data: no sockets, no files except key files, no torch import at module
import time. Both the learner and the nodes import it; it imports nothing else of echorl.
"""

from .errors import ErrorCode, ProtocolError

__all__ = ["ErrorCode", "ProtocolError"]
