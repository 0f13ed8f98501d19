"""Preflight's probe pass under one fault at a time, on the test bed: seconds, and what failed.

Issue 39's case: `trainer preflight --skip deepspeed` (the probe pass: SSH trust, the interfaces, the
ports, the bandwidth between every pair, the clocks, the shared dir, ...) on the Molecule bed (ct-head,
ct-worker1, ct-worker2), timed and read from its JSON report:
- `healthy`: nothing changed;
- `one-way`: ct-worker2's firewall drops new connections from ct-head to the comm port range (SSH open,
  replies let through: an `iptables -I INPUT ... --ctstate NEW -j DROP`, ahead of ufw's chains);
- `host-key`: ct-worker1's sshd answers with another host key than the one every node and the
  controller pinned (a reinstalled node).
Each fault is put back after its run (the rule deleted; the old host key back, sshd reloaded). Prints,
per case, the seconds and the failed results (check, subject), against issue 39's goal: at most 60 s,
and only the faulty pair or node failed.

Run (the bed up: scripts/testbed/molecule.sh converge; a few minutes):
    .venv/bin/python bench/preflight_faults.py [--cases healthy,one-way,host-key]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))
from helpers.testbed_nodes import INVENTORY, STATUS, podman  # noqa: E402 - the bed tests' helpers

CASES = ("healthy", "one-way", "host-key")
GOAL_S = 60.0
HEAD_ADDRESS = "10.89.42.10"  # molecule/default/molecule.yml's fixed addresses
COMM_PORTS = "1024:65535"  # cluster_comm_port_range on the bed
HOST_KEY = "/etc/ssh/ssh_host_ed25519_key"


@contextlib.contextmanager
def one_way() -> Iterator[tuple[str, ...]]:
    rule = ["-p", "tcp", "-s", HEAD_ADDRESS, "--dport", COMM_PORTS, "-m", "conntrack", "--ctstate", "NEW",
            "-j", "DROP"]  # fmt: skip
    podman("exec", "ct-worker2", "iptables", "-I", "INPUT", "1", *rule)
    try:
        # The pair, in either of the report's forms (`ct-head <-> ct-worker2`, `ct-head -> ct-worker2`:
        # ct-worker2's sshd listens on 2222, inside the blocked range, so SSH from ct-head fails too).
        yield ("ct-head", "ct-worker2")
    finally:
        podman("exec", "ct-worker2", "iptables", "-D", "INPUT", *rule, check=False)


@contextlib.contextmanager
def host_key() -> Iterator[tuple[str, ...]]:
    node = "ct-worker1"
    podman("exec", node, "cp", "-p", HOST_KEY, f"{HOST_KEY}.bench")
    podman("exec", node, "cp", "-p", f"{HOST_KEY}.pub", f"{HOST_KEY}.pub.bench")
    try:
        podman(
            "exec",
            node,
            "sh",
            "-c",
            f"rm -f {HOST_KEY} {HOST_KEY}.pub && ssh-keygen -q -t ed25519 -N '' -f {HOST_KEY}",
        )
        podman("exec", node, "systemctl", "reload", "ssh")
        yield (node,)
    finally:
        podman("exec", node, "mv", f"{HOST_KEY}.bench", HOST_KEY, check=False)
        podman("exec", node, "mv", f"{HOST_KEY}.pub.bench", f"{HOST_KEY}.pub", check=False)
        podman("exec", node, "systemctl", "reload", "ssh", check=False)


@contextlib.contextmanager
def nothing() -> Iterator[tuple[str, ...]]:
    yield ()


FAULTS = {"healthy": nothing, "one-way": one_way, "host-key": host_key}


def preflight(report: Path) -> tuple[float, int, list[tuple[str, str]]]:
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "trainer", "preflight", "-i", str(INVENTORY), "--skip", "deepspeed",
         "--report", str(report)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    took = time.monotonic() - started
    try:
        results = json.loads(report.read_text())["results"]
    except (OSError, ValueError, KeyError):
        sys.exit(
            f"preflight wrote no report (exit {run.returncode}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}"
        )
    failed = [(r["check"], r["subject"]) for r in results if r["status"] not in ("pass", "skip", "warn")]
    return took, run.returncode, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    if unknown := sorted(set(cases) - set(CASES)):
        parser.error(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(CASES)}")
    if not (STATUS.exists() and STATUS.read_text().startswith("up")):
        parser.error(f"the test bed is not up ({STATUS}): scripts/testbed/molecule.sh converge first")
    print(
        f"load: {os.getloadavg()[0]:.1f} (1 min); trainer preflight --skip deepspeed on the test bed",
        flush=True,
    )
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp:
        for case in cases:
            with FAULTS[case]() as faulty:
                took, code, failed = preflight(Path(tmp) / f"{case}.json")
            # The pair blocked one way, or the node whose key changed (its pairs included).
            only_faulty = all(all(name in subject for name in faulty) for _, subject in failed)
            verdict = "within" if took <= GOAL_S else "over"
            print(
                f"{case:9} {took:6.1f} s ({verdict} the goal of {GOAL_S:.0f} s), exit {code}, failed: "
                + (", ".join(f"{check} {subject}" for check, subject in failed) or "nothing"),
                flush=True,
            )
            if case == "healthy":
                ok &= not failed
            else:
                ok &= bool(failed) and only_faulty
                print(
                    f"          only {' and '.join(faulty)} failed: {'yes' if only_faulty else 'NO'}",
                    flush=True,
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
