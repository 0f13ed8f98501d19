"""What the `trainer push` tests share: running the verb and reading a tree's content."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path


def push(
    inventory: Path, *args: str, timeout: float = 120, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`trainer push -i INVENTORY ARGS...` as a user runs it, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "trainer", "push", "-i", str(inventory), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def digests(tree: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under `tree` (the partial dir left out)."""
    return {
        str(path.relative_to(tree)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(tree.rglob("*"))
        if path.is_file() and ".push-partial" not in path.parts
    }
