"""The CPU seconds of a group of processes and of everything they start: where CI's CPU goes.

CI is bound by this machine's two cores (a whole run sampled: busy 94 % of the time, 97-100 % from
its fifth minute to its last), so a shorter CI needs less work, and less work needs to know whose
work it is. getrusage(RUSAGE_CHILDREN), which CI's report used, counts only the processes a chunk
waited for: a Slurm daemon, a simulated node's sshd and the Ansible modules run through it, anything
reparented to init are not (a chunk of real-Slurm tests read 23 CPU-s over 6.5 min). A cgroup counts
every process started in it, wherever it is reparented, until it exits.

    scripts/ci_cpu.py run NAME -- COMMAND...   run COMMAND in the group NAME; write its CPU seconds to
                                               .cache/ci/cpu/NAME.json (and tell each test's, below)

Inside a group, CPU_GROUP_ENV names the file that says the group's usage: tests/conftest.py reads it
before and after each test and appends the test's CPU seconds to CPU_LOG_ENV's file (JSON lines).
The test bed's containers run in podman's own cgroups; the bed's conftest adds theirs
(`containers_seconds`). Where no cgroup can be made (not root, no cpuacct), nothing is measured and
the command runs all the same. Standard library only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".cache" / "ci" / "cpu"
#: The file whose content says the group's CPU (set in every process of a group).
CPU_GROUP_ENV = "CLUSTERTRAIN_CI_CPU_GROUP"
#: The JSON-lines file each test's CPU seconds go to.
CPU_LOG_ENV = "CLUSTERTRAIN_CI_CPU_LOG"
#: cgroup v1's CPU accounting (nanoseconds in cpuacct.usage), then v2's (usage_usec in cpu.stat).
V1_ROOT = Path("/sys/fs/cgroup/cpuacct")
V2_ROOT = Path("/sys/fs/cgroup")
PARENT = "clustertrain-ci"


def usage_seconds(usage_file: str | Path) -> float | None:
    """The CPU seconds a group's usage file says (cpuacct.usage or cpu.stat), None if unreadable."""
    path = Path(usage_file)
    try:
        text = path.read_text()
    except OSError:
        return None
    if path.name == "cpuacct.usage":
        return int(text.strip()) / 1e9
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    return None


def make_group(name: str) -> Path | None:
    """A fresh cgroup for NAME (its usage file), or None where none can be made here."""
    if (V1_ROOT / "cpuacct.usage").is_file():
        root, usage = V1_ROOT, "cpuacct.usage"
    elif (V2_ROOT / "cgroup.controllers").is_file():
        root, usage = V2_ROOT, "cpu.stat"
    else:
        return None
    group = root / PARENT / f"{name}-{os.getpid()}"
    try:
        group.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return group / usage


def join_group(usage_file: Path) -> None:
    """Move this process into the group (its children follow)."""
    (usage_file.parent / "cgroup.procs").write_text(f"{os.getpid()}\n")


def joiner(usage_file: Path | None):  # -> Callable[[], None] | None, subprocess's preexec_fn
    """What a child runs before its command to join the group (None: no group)."""
    return None if usage_file is None else functools.partial(join_group, usage_file)


def remove_group(usage_file: Path) -> None:
    """Remove the group when nothing runs in it any more (a daemon left behind keeps it)."""
    with contextlib.suppress(OSError):
        usage_file.parent.rmdir()


def containers_seconds(names_prefix: str) -> float | None:
    """The CPU seconds of the running podman containers whose names start with names_prefix, from
    their cgroups (since each started), or None where podman or their cgroups cannot be read."""
    try:
        listed = subprocess.run(
            ["podman", "ps", "--no-trunc", "--filter", f"name=^{names_prefix}", "--format", "{{.ID}}"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    total, found = 0.0, False
    for container in listed:
        cgroups = [
            *V1_ROOT.rglob(f"*{container}*/cpuacct.usage"),
            *V2_ROOT.glob(f"**/*{container}*/cpu.stat"),
        ]
        for usage in cgroups:
            if (seconds := usage_seconds(usage)) is not None:
                total, found = total + seconds, True
                break
    return total if found else None


def run_measured(name: str, command: list[str], tests_log: Path, **run_args) -> tuple[int, float | None]:
    """COMMAND (subprocess.run with run_args) in a fresh group NAME, each of its tests' CPU seconds
    into tests_log: its exit code and CPU seconds (None where no group could be made)."""
    usage = make_group(name)
    env = dict(run_args.pop("env", None) or os.environ)
    if usage is not None:
        env[CPU_GROUP_ENV] = str(usage)
        env[CPU_LOG_ENV] = str(tests_log)
    rc = subprocess.run(command, env=env, preexec_fn=joiner(usage), **run_args).returncode
    if usage is None:
        return rc, None
    seconds = usage_seconds(usage)
    remove_group(usage)
    return rc, seconds


def run(name: str, command: list[str]) -> int:
    """COMMAND in the group NAME; its CPU seconds to OUT/NAME.json. Its exit code."""
    OUT.mkdir(parents=True, exist_ok=True)
    rc, seconds = run_measured(name, command, OUT / f"{name}.tests.jsonl")
    (OUT / f"{name}.json").write_text(json.dumps({"name": name, "cpu_seconds": seconds}))
    return rc


def main() -> int:
    args = sys.argv[1:]
    if len(args) < 4 or args[0] != "run" or args[2] != "--":
        print(__doc__.split("\n\n")[2], file=sys.stderr)
        return 2
    return run(args[1], args[3:])


if __name__ == "__main__":
    sys.exit(main())
