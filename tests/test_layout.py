"""The package map of docs/architecture.md, enforced: imports point one way, no module grows
past ~500 lines. Parsed with ``ast`` (nothing is imported), so it also sees lazy imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"protocol", "net", "broadcast", "actor", "tasks", "learner", "node", "echorl"}

#: what each package may import from echorl (besides itself); ``echorl`` here means the
#: top-level helpers (echorl.atomic), not the CLI modules that wire the roles together.
ALLOWED = {
    "protocol": set(),
    "tasks": set(),
    "net": {"protocol"},
    "broadcast": {"protocol", "net"},
    "actor": {"protocol", "tasks", "echorl"},
    "learner": {"protocol", "net", "broadcast", "actor", "tasks", "echorl"},
    "node": {"protocol", "net", "broadcast", "actor", "tasks", "echorl"},
}
TOP_LEVEL_HELPERS = {"echorl.atomic", "echorl.config", "echorl.metrics_sinks"}
MAX_LINES = 520


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).glob("*.py"):
            out[f"{pkg}/{path.name}"] = path
    return out


def _echorl_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("echorl"):
            names.add(node.module if node.level == 0 else "")
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("echorl"))
    return {n for n in names if n}


def _package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] in PACKAGES - {"echorl"}:
        return parts[1]
    return "echorl"


def test_imports_point_one_way():
    bad = []
    for rel, path in _modules().items():
        pkg = rel.split("/")[0]
        if pkg == "echorl":
            continue
        for name in _echorl_imports(path):
            target = _package_of(name)
            if target == pkg or name in ("echorl",):
                continue
            if target == "echorl" and not any(name.startswith(h) for h in TOP_LEVEL_HELPERS):
                bad.append(f"{rel} imports {name} (CLI wiring)")
            elif target != "echorl" and target not in ALLOWED[pkg]:
                bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(sorted(bad))


def test_no_module_over_the_size_limit():
    long = {rel: n for rel, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_no_learner_module_left_under_node():
    assert not list((ROOT / "node").glob("learner_*.py"))
