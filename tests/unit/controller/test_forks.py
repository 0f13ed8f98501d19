"""trainer/controller/forks.py: how many nodes this controller follows at once, derived from its open
files, memory and CPUs; a job past the least of them is refused with the resource and its fix.

The memory cost per node itself is measured against the real thing in
tests/local/test_forks_memory.py (simulated nodes, the controller's PSS while it follows)."""

from __future__ import annotations

import resource
import subprocess
import sys

from trainer.controller import forks
from trainer.controller.forks import ForkLimits

GIB = 2**30
PLENTY_FILES = 1 << 20


def test_memory_allows_half_of_what_is_available_at_the_measured_cost_per_node():
    limits = ForkLimits(PLENTY_FILES, PLENTY_FILES, available_bytes=8 * GIB, cpus=64)
    expected = (4 * GIB) // forks.BYTES_PER_NODE
    assert limits.nodes == limits.by_memory == expected
    assert limits.follow_problem(expected) is None
    refusal = limits.follow_problem(expected + 1)
    assert f"can follow {expected} nodes at once and the job has {expected + 1}" in refusal
    assert f"node {expected + 1} and later would go unwatched" in refusal
    assert f"8.0 GiB available allows {expected} nodes at {forks.BYTES_PER_NODE // 2**20} MiB each" in refusal
    assert "free memory or use a larger controller" in refusal


def test_open_files_bound_the_nodes_and_the_refusal_says_how_to_raise_them():
    # 72 descriptors: 64 kept for the run, 4 per node (ansible-playbook's pipes to each worker).
    limits = ForkLimits(72, 4096, available_bytes=64 * GIB, cpus=64)
    assert limits.nodes == limits.by_files == 2
    refusal = limits.follow_problem(3)
    assert "RLIMIT_NOFILE 72 (hard limit 4096) allows 2 nodes" in refusal
    assert "ulimit -n 65536" in refusal


def test_cpus_bound_the_nodes_on_a_small_controller_with_plenty_of_memory():
    limits = ForkLimits(PLENTY_FILES, PLENTY_FILES, available_bytes=1024 * GIB, cpus=1)
    assert limits.nodes == limits.by_cpu == forks.NODES_PER_CPU
    assert "1 CPUs follow 250 nodes at 250 per CPU" in limits.follow_problem(251)


def test_unknown_available_memory_does_not_bind():
    limits = ForkLimits(1088, 1088, available_bytes=0, cpus=64)
    assert limits.nodes == limits.by_files == (1088 - forks.FILES_RESERVED) // forks.FILES_PER_NODE


def test_forks_are_one_per_node_within_the_limit_and_never_fewer_than_ansible_s_few():
    limits = ForkLimits(72, 72, available_bytes=64 * GIB, cpus=64)  # 2 nodes at once
    assert limits.forks(1) == forks.FEWEST_FORKS
    roomy = ForkLimits(PLENTY_FILES, PLENTY_FILES, available_bytes=64 * GIB, cpus=64)
    assert roomy.forks(40) == 40
    assert roomy.forks(10**6) == roomy.nodes


def test_the_machine_s_limits_come_from_its_soft_limit_raised_to_the_hard_one():
    # In a child whose soft limit starts below the hard one, as many systems start a shell (1024).
    soft, hard = 256, min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    code = (
        f"import resource; resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard})); "
        "from trainer.controller import forks; l = forks.limits(); "
        "print(l.open_files, l.open_files_hard, l.available_bytes > 0, l.cpus >= 1)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(hard), str(hard), "True", "True"]
