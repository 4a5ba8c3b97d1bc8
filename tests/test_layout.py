"""The package map of docs/architecture.md, enforced. Parsed with ``ast`` (nothing is imported),
so it also sees lazy imports:

- every package is a folder under ``echorl/`` and imports point one way (``ALLOWED``);
- ``echorl.cli`` (the command-line roof) is imported by nothing, ``echorl.common`` (the
  basement: settings, crash-safe writes, metrics sinks) imports no other echorl package;
- sockets and py-libp2p are touched only under ``echorl/net/``;
- no mixins (a class is one thing, not a file split for size); no module past ``MAX_LINES``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "echorl"

#: what each package may import from echorl besides itself
ALLOWED: dict[str, set[str]] = {
    "common": set(),
    "protocol": {"common"},
    "tasks": {"common"},
    "net": {"protocol", "common"},
    "broadcast": {"protocol", "net", "common"},
    "actor": {"protocol", "tasks", "common"},
    "rl": {"protocol", "tasks", "actor", "common"},
    "learner": {"protocol", "net", "broadcast", "actor", "tasks", "rl", "common"},
    "node": {"protocol", "net", "broadcast", "actor", "tasks", "common"},
    "service": {"protocol", "net", "broadcast", "actor", "tasks", "rl", "learner", "common"},  # --swarm: a learner peer
    "cli": {"protocol", "net", "broadcast", "actor", "tasks", "rl", "learner", "node", "service", "common"},
}
#: modules whose import means "I open sockets / speak libp2p": only ``echorl/net`` may
NETWORK_MODULES = ("socket", "libp2p", "multiaddr", "ssl")
NETWORK_TRIO_CALLS = {"open_tcp_stream", "open_tcp_listeners", "serve_tcp", "socket", "SocketStream", "SocketListener"}
MAX_LINES = 520


def _modules() -> dict[str, Path]:
    return {str(p.relative_to(PKG)): p for p in PKG.rglob("*.py")}


def _package(rel: str) -> str:
    parts = rel.split("/")
    return parts[0] if len(parts) > 1 else ""  # "" : echorl/__init__.py and echorl/__main__.py


def _echorl_imports(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("echorl") and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("echorl"))
    return names


def _target(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_package_is_a_folder_under_echorl():
    strays = [p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name != "echorl"]
    assert not strays, f"packages outside echorl/: {strays}"
    assert set(ALLOWED) <= {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}


def test_imports_point_one_way():
    bad = []
    for rel, path in _modules().items():
        pkg = _package(rel)
        for name in _echorl_imports(ast.parse(path.read_text())):
            target = _target(name)
            if target in ("", pkg) or (pkg == "" and target == "cli"):
                continue
            if pkg == "":
                bad.append(f"{rel} imports {name} (the package root imports nothing)")
            elif target not in ALLOWED.get(pkg, set()):
                bad.append(f"{rel} imports {name}")
    assert not bad, "\n".join(sorted(bad))


def test_sockets_and_libp2p_only_in_net():
    bad = []
    for rel, path in _modules().items():
        if _package(rel) == "net":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                bad += [f"{rel}: import {a.name}" for a in node.names if a.name.split(".")[0] in NETWORK_MODULES]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] in NETWORK_MODULES:
                    bad.append(f"{rel}: from {node.module}")
                elif node.module.split(".")[0] == "trio":
                    bad += [f"{rel}: from trio import {a.name}" for a in node.names if a.name in NETWORK_TRIO_CALLS]
            elif (
                isinstance(node, ast.Attribute)
                and node.attr in NETWORK_TRIO_CALLS
                and isinstance(node.value, ast.Name)
                and node.value.id == "trio"
            ):
                bad.append(f"{rel}: trio.{node.attr}")
    assert not bad, "\n".join(sorted(set(bad)))


def test_no_mixins():
    """A class whose bases include another echorl class that is not an ABC, Protocol, exception
    or pydantic model is a mixin split: say what it is instead (a component it owns)."""
    bad = []
    for rel, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any("Mixin" in ast.unparse(b) for b in node.bases):
                bad.append(f"{rel}: {node.name}")
            if isinstance(node, ast.ClassDef) and "mixin" in (ast.get_docstring(node) or "").lower():
                bad.append(f"{rel}: {node.name} (docstring)")
    assert not bad, bad


def test_no_module_over_the_size_limit():
    long = {rel: n for rel, p in _modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_every_module_is_documented():
    missing = [rel for rel, p in _modules().items() if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, missing
