"""CI's bed-free work as one queue that both sides of `.ci/run` take from.

`.ci/run` runs the test bed's side (`make molecule`: containers, converge, the bed's tests) beside
the bed-free tests. Which side ends last changed from run to run (the bed's side was the longer one,
then the bed-free tests grew to 72 of CI's 90 minutes), and a fixed split goes stale as tests are
added. So the bed-free work is a list of chunks: the bed-free side starts taking them at once, the
bed's side joins when `make molecule` ends, and each chunk is taken by whichever side is free first
(a directory created with mkdir is the claim: atomic, no daemon). The union of the chunks is every
bed-free test `make test` selects (SELECTION over tests/: not the bed's, nor their bed_twin twins),
checked at the start: a test file no chunk names lands in the last chunk, none is lost.

    scripts/ci_queue.py work SIDE     take and run chunks until none is left
    scripts/ci_queue.py report        per chunk: who ran it, minutes, result; the slowest tests;
                                      the end of every failed chunk's log; exit 1 if any failed
                                      or was never run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUEUE = REPO / ".cache" / "ci" / "queue"
#: What `make test` selects bed-free: not the bed's tests, which the bed's side runs, nor their
#: bed-free twins (marked bed_twin), whose scenario and assertions those tests cover on real hosts.
SELECTION = "not testbed and not bed_twin"
PYTEST = [str(REPO / ".venv" / "bin" / "pytest"), "-q", "-m", SELECTION, "--durations=15"]

#: The longest first (from CI's own durations, then a machine at load 10+), so the side that joins
#: late finds the short ones left. Each entry: a chunk name and its paths under tests/ (files or
#: folders).
#: The simulated-node tests are one chunk: they load the CPU with up to 8 nodes each.
HEAVY_FIRST: list[tuple[str, list[str]]] = [
    ("zero-resize", ["local/test_ds_resize.py"]),
    ("finetune-engines", ["local/test_finetune_engines.py"]),
    ("simulated-nodes", ["local/test_launch_scale.py", "local/test_scale_costs.py"]),
    ("simulated-preflight", ["local/test_preflight_scale.py"]),
    ("finetune-launch", ["local/test_finetune_launch_local.py", "local/test_prepared_data_local.py"]),
    ("launch-failures", ["local/test_launch_resilience_local.py", "local/test_launch_root_cause_local.py"]),
    ("launch", ["local/test_launch_local.py", "local/test_launcher_forms_local.py"]),
    ("disk-and-checkpoints", ["local/test_disk_full.py", "local/test_trainer_checkpoints.py"]),
    ("unit-node", ["unit/node"]),
]
#: Lint first, on the side that starts at once: a minute of CPU that the bed's side, CI's longest,
#: no longer waits for before its containers start (a failure still fails CI, in the report).
BEFORE = [("lint", ["make", "lint"])]
#: What is not a pytest chunk: the docs site built strict, then the README's set-up in a bare
#: container (podman, several minutes): last, when the bed's containers are gone.
AFTER = [
    ("docs", ["make", "docs"]),
    ("fresh-install", ["scripts/testbed/fresh-install.sh"]),
]
#: The rest of tests/local goes in chunks of this many files (pytest's start, about 7 CPU-s with
#: torch and Ansible imported, is paid once per chunk).
LOCAL_PER_CHUNK = 5


def chunks() -> list[tuple[str, list[str]]]:
    """(name, command) for every chunk, in the order they are taken."""
    named = {f"tests/{path}" for _, paths in HEAVY_FIRST for path in paths}
    missing = [path for path in named if not (REPO / path).exists()]
    if missing:
        sys.exit(f"ci_queue: HEAVY_FIRST names what is not there: {', '.join(sorted(missing))}; fix the list")

    def taken(path: Path) -> bool:
        relative = path.relative_to(REPO)
        return any(str(relative) == p or str(relative).startswith(p + "/") for p in named)

    local = [p for p in sorted((REPO / "tests" / "local").glob("test_*.py")) if not taken(p)]
    per = LOCAL_PER_CHUNK
    rest_local = [
        (f"local-{i // per + 1}", [str(p.relative_to(REPO)) for p in local[i : i + per]])
        for i in range(0, len(local), per)
    ]
    everything_else = [
        str(p.relative_to(REPO))
        for p in sorted((REPO / "tests").rglob("test_*.py"))
        if not taken(p) and p not in local and "testbed" not in p.relative_to(REPO).parts
    ]
    heavy = [(name, [f"tests/{path}" for path in paths]) for name, paths in HEAVY_FIRST]
    pytest_chunks = [*heavy, *rest_local, ("unit-and-the-rest", everything_else)]
    return [*BEFORE, *((name, [*PYTEST, *paths]) for name, paths in pytest_chunks if paths), *AFTER]


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
        started = time.monotonic()
        with open(log, "w") as out:
            rc = subprocess.run(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT).returncode
        seconds = time.monotonic() - started
        record = {"name": name, "side": side, "rc": rc, "seconds": round(seconds, 1), "log": str(log)}
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
        table.append(f"  {name:<22} {record['side']:<5} {record['seconds'] / 60:5.1f} min  {result}")
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
    print("== the bed-free chunks: who ran each, minutes, result")
    print("\n".join(table))
    return 1 if not_run or failed else 0


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
