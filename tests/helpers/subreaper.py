"""Run a command under a child subreaper and say which of its processes outlived it.

`python -m helpers.subreaper NEEDLE... -- COMMAND...` (tests/ on PYTHONPATH, which COMMAND does not
get) makes itself the subreaper of COMMAND's tree (prctl PR_SET_CHILD_SUBREAPER): whatever COMMAND
starts and leaves behind (a setsid'd launch, a daemonised iperf3 server, a node task's orphans) is
reparented here, not to init. Its first line of stdout is COMMAND's pid (signal that one, as a
user's Ctrl-C or a scheduler would); then COMMAND's output; once COMMAND has ended, its last line is
`LEFT <json>`: the live descendants whose environment holds any NEEDLE, with their command lines.
Its exit code is COMMAND's.

Why not scan /proc for the needles: CI runs other chunks' preflights and launches on this machine at
the same moment, with the same tags in their environments; only descent tells this run's apart.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.trainer_harness import descendants

PR_SET_CHILD_SUBREAPER = 36


def left_behind(root: int, needles: list[str]) -> list[dict]:
    """The live processes below `root` whose environment holds any of `needles` (a zombie's reads
    as empty)."""
    left = []
    for pid in descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(needle.encode() in environ for needle in needles):
            left.append({"pid": pid, "cmdline": cmdline.strip()})
    return left


def main(argv: list[str]) -> int:
    split = argv.index("--")
    needles, command = argv[:split], argv[split + 1 :]
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.exit(f"subreaper: prctl failed: {os.strerror(ctypes.get_errno())}")
    child = subprocess.Popen(command, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    print(child.pid, flush=True)
    rc = child.wait()
    print("LEFT " + json.dumps(left_behind(os.getpid(), needles)), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
