"""Key files with the problems a user meets (tests of ``protocol/identity.py`` and of every
role's pre-flight check share them)."""

from __future__ import annotations

from pathlib import Path

#: each kind :func:`unusable_key` makes
KEY_PROBLEMS = ("open", "corrupt", "short", "directory", "unmakeable-parent")


def unusable_key(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A key path with one of the problems a user meets, and the words its error must contain."""
    path = tmp_path / "node.key"
    if kind == "open":
        path.write_bytes(b"\0" * 32)
        path.chmod(0o644)
        return path, "chmod 600"
    if kind in ("corrupt", "short"):
        path.write_bytes(b"not a key at all, just some text\n" if kind == "corrupt" else b"\1" * 7)
        path.chmod(0o600)
        return path, "not a 32-byte Ed25519 seed"
    if kind == "directory":
        path.mkdir()
        return path, "is a directory"
    (tmp_path / "file").write_text("")  # "missing parent": one that cannot be made (a file is in the way)
    return tmp_path / "file" / "keys" / "node.key", "cannot create key file"
