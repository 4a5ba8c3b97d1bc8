"""Learner memory while it publishes a version: the state dict streamed to a staging file and
broadcast from it memory-mapped (``Publisher.publish``), against the in-memory path it replaced
(``state_dict_to_safetensors`` bytes handed to ``Broadcaster.publish``), each in a fresh process.

    python bench/publish_memory.py --size-mb 512 --json

Prints one JSON line: ``state_dict_mb`` (the model's tensors), and per path
``*_anon_peak_extra_mb``: the process's peak anonymous memory (``RssAnon``, sampled every 10 ms)
minus its value once the state dict was built, i.e. the memory publishing one full version and
then a delta (a few changed weights) takes on top of the model; ``*_rss_peak_extra_mb`` the same
for the whole RSS (``ru_maxrss``), which also counts the page-cache pages a memory-mapped file
has been read through (reclaimable, shared with the page cache: not the process's own).
No nodes are joined: this is the learner's side alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def _sample_anon(peak: list[float], stop) -> None:
    while not stop.wait(0.01):
        peak[0] = max(peak[0], _status_mb("RssAnon"))


def _child(mode: str, size_mb: float) -> dict:
    import threading

    import torch
    import trio

    from echorl.broadcast.broadcaster import Broadcaster
    from echorl.learner.publish import Publisher
    from echorl.net.host import open_host
    from echorl.protocol import snapshot
    from echorl.protocol.identity import Identity

    n = int(size_mb * 2**20 / 4 / 4096)
    sd = {f"layer{i}": torch.randn(n, 1024) for i in range(4)}
    base, anon_base = _status_mb("VmRSS"), _status_mb("RssAnon")
    anon_peak, stop = [anon_base], threading.Event()
    sampler = threading.Thread(target=_sample_anon, args=(anon_peak, stop), daemon=True)
    sampler.start()

    class Service:
        def note_published(self, version: int, weights_bytes: int) -> None:
            pass

        def broadcast_nodes(self) -> list:
            return []

    async def main() -> None:
        li = Identity.generate()
        async with open_host(li) as lh:
            bc = Broadcaster(
                lh,
                li,
                "bench",
                full_every=4,
                direct=False,
                store_dir=Path(tempfile.mkdtemp(prefix="echorl-bench-pub-")),
            )
            bc.install()
            pub = Publisher(bc, Service())  # type: ignore[arg-type]
            for version in (0, 1):
                sd["layer0"][0, : 64 * version] += 1.0
                if mode == "file":
                    await pub.publish(version, sd)
                else:
                    data = await trio.to_thread.run_sync(snapshot.state_dict_to_safetensors, sd)
                    await bc.publish(version, data, [])
                    del data

    trio.run(main)
    stop.set()
    sampler.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "state_dict_mb": round(sum(t.numel() * 4 for t in sd.values()) / 2**20, 1),
        "anon_peak_extra_mb": round(anon_peak[0] - anon_base, 1),
        "rss_peak_extra_mb": round(peak - base, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=512.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=["file", "bytes"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.size_mb)))
        return
    out: dict = {"size_mb": args.size_mb}
    for mode in ("file", "bytes"):
        proc = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--size-mb", str(args.size_mb)],
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"),
        )
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        out["state_dict_mb"] = res["state_dict_mb"]
        out[f"{mode}_anon_peak_extra_mb"] = res["anon_peak_extra_mb"]
        out[f"{mode}_rss_peak_extra_mb"] = res["rss_peak_extra_mb"]
    out["baseline"] = "bytes: state_dict_to_safetensors + Broadcaster.publish(bytes), the path before"
    print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
