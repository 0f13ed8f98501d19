"""CI's bed-free work as one queue that every worker of `.ci/run` takes from.

`.ci/run` runs the test bed's side (`make molecule`: containers, converge, the bed's tests) beside
the bed-free tests. Which side ends last changed from run to run (the bed's side was the longer one,
then the bed-free tests grew to 72 of CI's 90 minutes), and a fixed split goes stale as tests are
added. So the bed-free work is a list of chunks: the bed-free workers (two, niced, so the bed's side
keeps the CPU it waits on and they take what it leaves idle) start taking them at once, the bed's
side joins when `make molecule` ends, and each chunk is taken by whichever worker is free first (a
directory created with mkdir is the claim: atomic, no daemon). The chunks are taken longest first,
so the ones left at the end, when a worker idles while another finishes, are short. The union of
the chunks is every bed-free test `make test` selects (SELECTION over tests/: not the bed's, nor
their bed_twin twins), checked at the start: a test file no chunk names lands in a local-N chunk,
none is lost.

    scripts/ci_queue.py work SIDE     take and run chunks until none is left
    scripts/ci_queue.py report        per chunk: who ran it, minutes (wall and CPU), result; the
                                      slowest tests; the tests that cost the most CPU (ci_cpu.py);
                                      the end of every failed chunk's log; exit 1 if any failed or
                                      was never run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# scripts/ci_cpu.py, beside this file, however this one is loaded (run, or imported by its tests).
sys.path.insert(0, str(REPO / "scripts"))
import ci_cpu  # noqa: E402

QUEUE = REPO / ".cache" / "ci" / "queue"
#: What `make test` selects bed-free: not the bed's tests, which the bed's side runs, nor their
#: bed-free twins (marked bed_twin), whose scenario and assertions those tests cover on real hosts.
SELECTION = "not testbed and not bed_twin"
PYTEST = [str(REPO / ".venv" / "bin" / "pytest"), "-q", "-m", SELECTION, "--durations=15"]


def tests(*paths: str) -> list[str]:
    """The pytest command of a chunk of test files or folders (paths under tests/)."""
    return [*PYTEST, *(f"tests/{path}" for path in paths)]


#: Lint first, on the workers that start at once: a minute of CPU that the bed's side, CI's longest,
#: no longer waits for before its containers start (a failure still fails CI, in the report).
BEFORE = [("lint", ["make", "lint"])]
#: Then the named chunks, longest first (each one's wall minutes in the last CI run on this 2-core
#: machine, 67 min at load 10-20, are on its line; a quiet machine takes about half): the workers
#: that come free late, the bed's side among them, find only short ones left, so none idles long
#: while another finishes. A test file named nowhere goes into a local-N chunk (tests/local, five
#: files each) or unit-and-the-rest, after these. The simulated-node tests load the CPU with up to 8
#: nodes each. The README's set-up in a bare container (podman, on podman's default network, its own
#: --rm container: nothing of the bed's) is a chunk like the others.
HEAVY_FIRST: list[tuple[str, list[str]]] = [
    ("zero-resize", tests("local/test_ds_resize.py")),  # 19-23 min
    ("unit-node", tests("unit/node")),  # 18.0
    # 10.2, and ~0.7 since its attach test also restarts (moved from the bed: 5.5 min of the critical path)
    ("launch-resilience-sim", tests("local/test_launch_resilience_sim.py")),
    ("unit-controller", tests("unit/controller")),  # 9.7
    ("finetune-engines", tests("local/test_finetune_engines.py")),  # 7.3
    # Every test of a real Slurm, one cluster at a time: trainer launch inside an allocation (~2, and ~6
    # at load 8-13 for the restarts' three runs), the time limit's checkpoint and requeue (~2), sbatch,
    # trainer launch --slurm from a login node (~1).
    (
        "slurm",
        tests(
            "local/test_slurm_guest.py",
            "local/test_slurm_guest_restarts.py",
            "local/test_slurm_preemption.py",
            "local/test_sbatch.py",
            "local/test_slurm_login.py",
        ),
    ),
    # 11.7 before its five loopback twins of launch-resilience-sim's tests left CI (bed_twin): ~5.5
    ("launch-resilience", tests("local/test_launch_resilience_local.py")),
    # 7.4 before its two loopback twins of launch-sim's tests left CI (bed_twin): ~5.4
    ("launch", tests("local/test_launch_local.py", "local/test_launcher_forms_local.py")),
    ("fresh-install", ["scripts/testbed/fresh-install.sh"]),  # 4.8
    ("disk-full", tests("local/test_disk_full.py")),  # 4.5
    ("trainer-engines", tests("local/test_trainer_engines.py")),  # 4.3
    # 4.0 (moved from the bed: 95 s), and ~3 for the rejoin test (a lost node comes back)
    ("node-loss-sim", tests("local/test_node_loss_sim.py")),
    ("launch-sim", tests("local/test_launch_sim.py")),  # 3.2 (moved from the bed: 54 s there)
    ("simulated-nodes", tests("local/test_launch_scale.py", "local/test_scale_costs.py")),  # 2.7
    ("health-and-forks", tests("local/test_health_training.py", "local/test_forks_memory.py")),  # 2.4
    ("simulated-preflight", tests("local/test_preflight_scale.py")),  # 2.4
    (
        "finetune-launch",
        tests("local/test_finetune_launch_local.py", "local/test_prepared_data_local.py"),
    ),  # 1.5
]
#: What is not a pytest chunk, last: the docs site built strict (seconds).
AFTER = [("docs", ["make", "docs"])]
#: The rest of tests/local goes in chunks of this many files (pytest's start, about 7 CPU-s with
#: torch and Ansible imported, is paid once per chunk).
LOCAL_PER_CHUNK = 5


def chunk_paths(command: list[str]) -> list[str]:
    """The test files and folders a chunk's command names (none for a command that is not pytest)."""
    return [arg for arg in command if arg.startswith("tests/")]


def test_files(path: str) -> list[str]:
    """The test files at a path under the repo: the file itself, or a folder's test_*.py."""
    full = REPO / path
    found = sorted(full.rglob("test_*.py")) if full.is_dir() else [full]
    return [str(f.relative_to(REPO)) for f in found]


def chunks() -> list[tuple[str, list[str]]]:
    """(name, command) for every chunk, in the order they are taken."""
    named = [path for _, command in HEAVY_FIRST for path in chunk_paths(command)]
    missing = [path for path in named if not (REPO / path).exists()]
    if missing:
        sys.exit(f"ci_queue: HEAVY_FIRST names what is not there: {', '.join(sorted(missing))}; fix the list")

    # A file is run by the first chunk that names it (itself or its folder): unit/node's heaviest
    # files have a chunk of their own, and the folder's chunk, later, gets the rest of it.
    taken: set[str] = set()
    heavy: list[tuple[str, list[str]]] = []
    for name, command in HEAVY_FIRST:
        paths = chunk_paths(command)
        files = [f for path in paths for f in test_files(path)]
        left = [f for f in files if f not in taken]
        if paths and len(left) < len(files):
            command = [*PYTEST, *left]
        taken.update(files)
        heavy.append((name, command))

    local = [f for f in test_files("tests/local") if f not in taken]
    per = LOCAL_PER_CHUNK
    rest_local = [
        (f"local-{i // per + 1}", [*PYTEST, *local[i : i + per]]) for i in range(0, len(local), per)
    ]
    everything_else = [
        f for f in test_files("tests") if f not in taken and f not in local and "/testbed/" not in f
    ]
    rest = [*rest_local, ("unit-and-the-rest", [*PYTEST, *everything_else])]
    return [*BEFORE, *heavy, *((name, command) for name, command in rest if chunk_paths(command)), *AFTER]


def children_cpu_s() -> float:
    """User and system CPU seconds of every child process this one has waited for, so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def claim(index: int) -> bool:
    try:
        (QUEUE / f"{index:02d}.claimed").mkdir()
    except FileExistsError:
        return False
    return True


def work(side: str) -> int:
    QUEUE.mkdir(parents=True, exist_ok=True)
    failed = 0
    for index, (name, command) in enumerate(chunks()):
        if not claim(index):
            continue
        log = QUEUE / f"{index:02d}-{name}.log"
        print(f"ci_queue [{side}]: {name} ...", flush=True)
        started, began = time.monotonic(), time.time()
        cpu_before = children_cpu_s()
        # Each chunk in a cgroup of its own (ci_cpu.py): its CPU, and each of its tests', counts every
        # process it starts, daemons and reparented ones too.
        with open(log, "w") as out:
            rc, group_cpu = ci_cpu.run_measured(
                name,
                command,
                QUEUE / f"{index:02d}.tests.jsonl",
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        seconds = time.monotonic() - started
        record = {
            "name": name,
            "side": side,
            "rc": rc,
            "seconds": round(seconds, 1),
            # The CPU of every process it started (its cgroup; where none could be made, only those it
            # waited for); never a podman container's: near twice the wall time, the chunk had both
            # cores; far below, it waited.
            "cpu_seconds": round(group_cpu if group_cpu is not None else children_cpu_s() - cpu_before, 1),
            "began": round(began),
            "log": str(log),
        }
        (QUEUE / f"{index:02d}.done.json").write_text(json.dumps(record))
        print(f"ci_queue [{side}]: {name} rc={rc} in {seconds / 60:.1f} min", flush=True)
        failed += rc != 0
    return 1 if failed else 0


def report() -> int:
    """Printed in the order that CI's tail (the only part of the output CI shows) keeps best: what
    failed and why first, then the slowest tests, and last the one-line-per-chunk times."""
    not_run = 0
    slowest: list[tuple[float, str]] = []
    table: list[str] = []
    failed: list[tuple[str, list[str]]] = []  # (chunk, its log's lines)
    for index, (name, _) in enumerate(chunks()):
        done = QUEUE / f"{index:02d}.done.json"
        if not done.is_file():
            table.append(f"  {name:<22} NOT RUN")
            not_run += 1
            continue
        record = json.loads(done.read_text())
        result = "ok" if record["rc"] == 0 else f"FAILED rc={record['rc']}"
        cpu = record.get("cpu_seconds")
        cpu_text = f"cpu {cpu / 60:5.1f}" if cpu is not None else " " * 9
        table.append(
            f"  {name:<22} {record['side']:<5} {record['seconds'] / 60:5.1f} min  {cpu_text}  {result}"
        )
        lines = Path(record["log"]).read_text(errors="replace").splitlines()
        for line in lines:
            if match := re.match(r"(\d+\.\d+)s (call|setup|teardown)\s+(\S+)", line):
                slowest.append((float(match.group(1)), f"{match.group(2):<8} {match.group(3)}"))
        if record["rc"] != 0:
            failed.append((f"{name} ({record['log']})", lines))
    for chunk, lines in failed:
        # The assertion lines (pytest's `E `) say why; the summary's FAILED lines say which.
        why = [line for line in lines if line.startswith("E ")][:30]
        which = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        print(f"== the failed chunk {chunk}: why, then which")
        print("\n".join(why + which or lines[-40:]))
    print("== the slowest bed-free tests")
    for seconds, what in sorted(slowest, reverse=True)[:15]:
        print(f"  {seconds:7.1f}s {what}")
    print_cpu_costs()
    print("== the bed-free chunks: who ran each, minutes (wall, then CPU), result")
    print("\n".join(table))
    return 1 if not_run or failed else 0


def print_cpu_costs() -> None:
    """Where CI's CPU went (ci_cpu.py's groups): the tests that cost the most, the bed's and the
    bed-free tests alike, each with every process it started (a bed test with the containers' CPU in
    its time), and the totals. On this CPU-bound machine that is what makes CI long."""
    tests = []
    for log in [*QUEUE.glob("*.tests.jsonl"), *ci_cpu.OUT.glob("*.tests.jsonl")]:
        for line in log.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                entry = json.loads(line)
                tests.append((entry["cpu_s"], entry["wall_s"], entry["test"]))
    if not tests:
        return
    print("== the tests that cost the most CPU (CPU-s of every process each started, its wall seconds)")
    for cpu, wall, test in sorted(tests, reverse=True)[:20]:
        print(f"  {cpu:7.1f} CPU-s {wall:7.1f}s  {test}")
    chunks_cpu = sum(
        json.loads(done.read_text()).get("cpu_seconds") or 0 for done in QUEUE.glob("*.done.json")
    )
    bed = {}
    with contextlib.suppress(OSError, ValueError):
        bed = json.loads((ci_cpu.OUT / "bed.json").read_text())
    bed_text = (
        f"the bed's side {bed['cpu_seconds']:.0f} CPU-s on this machine (its containers' apart); "
        if bed.get("cpu_seconds") is not None
        else ""
    )
    measured = sum(test[0] for test in tests)
    print(
        f"   CPU: the bed-free chunks {chunks_cpu:.0f} CPU-s; {bed_text}{measured:.0f} CPU-s in the "
        f"{len(tests)} tests measured"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    verbs = parser.add_subparsers(dest="verb", required=True)
    verbs.add_parser("work").add_argument("side", help="a name for the side taking chunks (fast, bed)")
    verbs.add_parser("report")
    verbs.add_parser("list", help="the chunks, in order")
    args = parser.parse_args()
    if args.verb == "work":
        return work(args.side)
    if args.verb == "report":
        return report()
    for name, command in chunks():
        print(f"{name}: {' '.join(command)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
