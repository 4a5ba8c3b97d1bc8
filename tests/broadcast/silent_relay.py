"""Test double: a relay process that forwards no announcement (``tests/hostile.py``'s
``SilentRelay``), as ``python -m echorl.broadcast.relay_process`` runs an honest one.

    python tests/broadcast/silent_relay.py --learner MULTIADDR --run-id RUN ...   # relay_process flags
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the hostile doubles

from hostile import SilentRelay

from echorl.broadcast import relay_process

if __name__ == "__main__":
    relay_process.main(relay_class=SilentRelay)
