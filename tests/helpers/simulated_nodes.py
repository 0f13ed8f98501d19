"""Simulated nodes for the scale tests (issue 27): scripts/testbed/netns_nodes.py (network namespaces,
a real sshd each) and bench/scale.py's instruments (a cgroup per controller command), loaded once by
file path (neither is a package), so the tests and the benchmark count the same thing."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, path: Path) -> Any:
    if name in sys.modules:  # bench/scale.py loads netns_nodes under this name too
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


netns_nodes = _load("netns_nodes", REPO / "scripts" / "testbed" / "netns_nodes.py")
scale = _load("bench_scale", REPO / "bench" / "scale.py")

#: Why simulated nodes cannot run here (not root, no `ip netns`, no sshd), or None.
MISSING = netns_nodes.missing_requirements()
#: For a module or test that needs them.
NEEDS_NETNS = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture
def sim_workdir():
    """A directory the nodes' training user can enter (pytest's tmp_path sits under a 0700 one)."""
    with tempfile.TemporaryDirectory(prefix="ct-sim-") as tmp:
        Path(tmp).chmod(0o755)
        yield Path(tmp)
