"""A role's start-up objects leave the cyclic collector's reach (``echorl/common/gc_pauses.py``): at
1,000 peers the learner's full collections scanned ~460,000 start-up objects 24 times in ~100 s,
0.65-0.78 s each, and its loop stood still for each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from echorl.common.gc_pauses import GEN0_THRESHOLD

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import gc, json
kept = [{"n": [i]} for i in range(200_000)]  # what a role keeps for its lifetime: 400,000 tracked objects
before = len(gc.get_objects())
from echorl.common import gc_pauses
gc_pauses.after_start_up()
print(json.dumps([before, len(gc.get_objects()), gc.get_freeze_count(), gc.get_threshold()[0]]))
"""


def test_after_start_up_takes_what_start_up_built_out_of_the_collector_s_reach() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, cwd=ROOT)
    before, tracked, frozen, gen0 = json.loads(out.stdout)
    assert before > 400_000 and frozen >= 400_000  # frozen, not freed: the role still holds them
    assert tracked < 10_000  # what a full collection scans from now on
    assert gen0 == GEN0_THRESHOLD
