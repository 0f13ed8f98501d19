"""Simulated nodes for the scale tests (issue 27): scripts/testbed/netns_nodes.py (network namespaces,
a real sshd each) and bench/scale.py's instruments (a cgroup per controller command), loaded once by
file path (neither is a package), so the tests and the benchmark count the same thing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from helpers.bed_launch import TEST_SETS

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


def launch_command(cluster: Any, run_name: str, *sets: str) -> list[str]:
    """`trainer launch` of the bundled trainer on the cluster, with the bed's test settings and `sets`."""
    args = [a for s in (*TEST_SETS, *sets) for a in ("--set", s)]
    return [
        sys.executable,
        "-m",
        "trainer",
        "launch",
        "-i",
        str(cluster.inventory),
        "--run-name",
        run_name,
        *args,
    ]


def trainer_pids(cluster: Any, node: int) -> list[int]:
    """Node `node`'s `trainer train` processes (the ranks, not torchrun): those in its network namespace."""
    listed = subprocess.run(
        ["ip", "netns", "pids", cluster.namespaces[node]],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    pids = []
    for pid in listed.stdout.split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if len(argv) > 2 and argv[1].endswith(b"/trainer") and argv[2] == b"train":
            pids.append(int(pid))
    return pids
