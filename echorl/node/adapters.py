"""A node's side of LoRA versions (architecture §5, docs/protocol.md "Adapter versions"): when
the learner trains an adapter, each version's manifest names the base model by digest, and the
node applies the version to its own copy of that base (``--model``), held once.

:class:`NodeAdapters` hashes the node's base on the first adapter version (``actor/lora.py``:
``base_digest``; a worker thread, once per process), turns the engine into base + adapter on the
first one it loads (``lora.adapt_engine``: the torch engine through peft), and refuses — never
loads — a version for another base, or one whose adapter differs from the one attached; the
refusal is kept, and ``check`` raises it as one line (``BaseMismatch``) where the daemon ends the
node (exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from echorl.actor import lora
from echorl.protocol.messages import AdapterSpec, Manifest


@dataclass
class NodeAdapters:
    """The base this node holds and the adapter its engine was built for."""

    model_dir: Path
    spec: AdapterSpec | None = None  # the adapter the engine carries (None: plain weights so far)
    refused: str = ""  # why a version was refused (the node ends with this line)

    async def fits(self, manifest: Manifest | None) -> bool:
        """May this version load? False (and ``refused`` set) for another base or adapter."""
        spec = None if manifest is None else manifest.adapter
        if spec is None:
            if self.spec is not None and manifest is not None:
                self.refused = "the learner publishes full weights now, not adapters: restart the node"
            return self.spec is None
        digest = await trio.to_thread.run_sync(lora.base_digest, self.model_dir)
        try:
            lora.check_spec(spec, digest, self.model_dir)
        except lora.LoraError as exc:
            self.refused = str(exc)
            return False
        if self.spec is not None and spec != self.spec:
            self.refused = f"the run's adapter changed (rank {self.spec.rank} -> {spec.rank}): restart the node"
            return False
        return True

    def engine(self, backend: Any, manifest: Manifest | None) -> Any:
        """The engine a fitting version loads into: base + adapter from the first adapter version
        on (built once, in a worker thread), the engine itself otherwise."""
        spec = None if manifest is None else manifest.adapter
        if spec is None or self.spec is not None:
            return backend
        engine = lora.adapt_engine(backend, lora.spec_settings(spec))
        self.spec = spec
        return engine

    def check(self) -> None:
        if self.refused:
            raise lora.BaseMismatch(self.refused)
