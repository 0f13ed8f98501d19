"""How many nodes this controller can reach at once through Ansible: the one place fork limits are
derived (the launcher, status, stop, logs and preflight import it).

Ansible runs each host's task in a worker process of its own (a fork of ansible-playbook), up to
ANSIBLE_FORKS at a time. `trainer launch` follows every node with one task that lasts the whole run
(playbooks/start.yml's watch), so a node past the forks would not be followed until another node's
trainer ended: the launch needs a fork per node for its whole length, and refuses (before anything
starts, naming the limit and its fix) a cluster larger than this machine can follow.

What bounds the forks, measured on a 2-core, 23 GiB controller (ansible-core 2.19, `trainer launch
-- sleep 30` on 8 and 16 nodes, /proc/PID/fd and /proc/PID/smaps_rollup):
- open files: ansible-playbook holds FILES_PER_NODE descriptors per running worker (the pipes of
  its results and of each worker; 38 at 8 nodes, 70 at 16), and every worker inherits them, so one
  process needs about FILES_PER_NODE per node against RLIMIT_NOFILE. The launcher raises its soft
  limit to the hard one first (`raise_open_file_limit`; its children inherit it);
- memory: what the controller's processes take per followed node (the node's worker, its SSH
  master, the ssh client of each poll): BYTES_PER_NODE, against half of MemAvailable;
- CPU: following costs the controller a little per node (docs/scale.md); NODES_PER_CPU nodes per
  core keep following under half of each core.
"""

from __future__ import annotations

import functools
import os
import resource
from dataclasses import dataclass

#: File descriptors ansible-playbook (and each of its workers, which inherit them) holds per node.
FILES_PER_NODE = 4
#: Descriptors a run needs besides (Python, its imports, the runner's pipes, a worker's ssh client).
FILES_RESERVED = 64
#: Controller memory one followed node takes. Measured with bench/scale.py (`launch -- sleep` on 2 to
#: 64 simulated nodes, 2-core 23 GiB controller, ansible-core 2.19; two runs, load 4 to 39): while it
#: follows, the PSS summed over the launch's processes (/proc/PID/smaps_rollup, every shared page
#: split among its sharers) grows 17.7 and 18.9 MiB per added node (least squares over 2..32 and
#: 8..64), and the memory its cgroup is charged less page cache (anonymous and kernel memory, each
#: page once) 18.4 and 19.6 MiB; 1280 MiB PSS at 64 nodes. A worker's private pages are about 13 MiB
#: of it (ansible-playbook's copy-on-write pages that Python's reference counts touch). The sum of
#: resident sets grows 60 MiB per node: it counts the pages every worker still shares with
#: ansible-playbook again in each, so it is not what the forks take from MemAvailable. 20 MiB: the
#: largest growth measured, rounded up (tests/local/test_forks_memory.py measures it again).
BYTES_PER_NODE = 20 * 2**20
#: The share of MemAvailable the forks may take (the launcher, the OS and the user keep the rest).
MEMORY_SHARE = 0.5
#: Nodes one controller core follows (each costs it well under 0.2 % of a core; docs/scale.md).
NODES_PER_CPU = 250
#: Forks used by short runs on small clusters all the same (Ansible's own default is 5).
FEWEST_FORKS = 5


@dataclass(frozen=True)
class ForkLimits:
    """What this machine allows: nodes followed at once, by each resource, and the facts behind it."""

    #: RLIMIT_NOFILE's soft limit (after `raise_open_file_limit`), and its hard limit.
    open_files: int
    open_files_hard: int
    #: MemAvailable in bytes (/proc/meminfo; 0 where unknown).
    available_bytes: int
    #: CPUs this process may run on.
    cpus: int

    @property
    def by_files(self) -> int:
        return max(0, (self.open_files - FILES_RESERVED) // FILES_PER_NODE)

    @property
    def by_memory(self) -> int:
        if not self.available_bytes:
            return self.by_files  # unknown: not the bound
        return int(self.available_bytes * MEMORY_SHARE) // BYTES_PER_NODE

    @property
    def by_cpu(self) -> int:
        return self.cpus * NODES_PER_CPU

    @property
    def nodes(self) -> int:
        """Nodes followed at once: the least of the three."""
        return min(self.by_files, self.by_memory, self.by_cpu)

    def forks(self, nodes: int) -> int:
        """ANSIBLE_FORKS for a run on `nodes` nodes: one per node, within the machine's limit."""
        return max(FEWEST_FORKS, min(nodes, self.nodes))

    def binding(self) -> str:
        """The resource that sets `nodes`, with its numbers and how to raise it."""
        if self.nodes == self.by_files:
            return (
                f"open files: RLIMIT_NOFILE {self.open_files} (hard limit {self.open_files_hard}) allows "
                f"{self.by_files} nodes at {FILES_PER_NODE} descriptors each plus {FILES_RESERVED}; raise "
                "it (`ulimit -n 65536`, or nofile in /etc/security/limits.conf)"
            )
        if self.nodes == self.by_memory:
            return (
                f"memory: {self.available_bytes / 2**30:.1f} GiB available allows {self.by_memory} nodes at "
                f"{BYTES_PER_NODE // 2**20} MiB each in half of it; free memory or use a larger controller"
            )
        return (
            f"CPU: {self.cpus} CPUs follow {self.by_cpu} nodes at {NODES_PER_CPU} per CPU; use a "
            "controller with more CPUs"
        )

    def follow_problem(self, nodes: int, what: str = "follow") -> str | None:
        """Why `nodes` nodes cannot all be followed at once here, or None when they can."""
        if nodes <= self.nodes:
            return None
        return (
            f"this controller can {what} {self.nodes} nodes at once and the job has {nodes}: each node is "
            f"followed by an Ansible worker of its own for the whole run, so node {self.nodes + 1} and "
            f"later would go unwatched. Limit: {self.binding()}"
        )


def raise_open_file_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (children inherit it); the new soft
    limit. Many systems start processes at 1024 soft with a hard limit far higher."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _finite(limit: int) -> int:
    return 1 << 20 if limit == resource.RLIM_INFINITY else limit


@functools.cache
def limits() -> ForkLimits:
    """This machine's limits, read once per process (a prestarted run and the run that takes it over
    must be given the same forks), after raising the open-file limit."""
    soft = raise_open_file_limit()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return ForkLimits(_finite(soft), _finite(hard), _available_bytes(), cpus)


def fork_limit() -> int:
    """Forks this machine holds at once (for runs of short tasks: status, stop, preflight's probes)."""
    return max(FEWEST_FORKS, limits().nodes)


def forks_for(nodes: int) -> int:
    """ANSIBLE_FORKS for a run on `nodes` nodes: every node at once, within this machine's limit."""
    return limits().forks(nodes)
