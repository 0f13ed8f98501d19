#!/usr/bin/env python3
"""End what a stopped preflight left on this node. Prints JSON; never fails.

    cleanup.py --marker NAME --token T                       processes whose environment has NAME=T
                                                            (TERM, then KILL): listener, iperf3
    cleanup.py --marker NAME --token T --shared-dir DIR      also its marker files in DIR
               [--locks-newer-than EPOCH]                    and build locks nobody holds made since
                                                            then (a stopped DeepSpeed job's), with
                                                            the training venv's python

Processes are matched by their environment, not their name, so only preflight's own are touched.
"""

import argparse
import contextlib
import glob
import json
import os
import signal
import sys
import time


def marked(marker):
    wanted = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if wanted in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def end(marker, grace_s=3.0):
    killed = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [pid for pid in marked(marker) if pid not in (os.getpid(), os.getppid())]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
                killed.append(pid)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in pids):
            time.sleep(0.1)
    return sorted(set(killed))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marker", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--shared-dir", default="")
    parser.add_argument("--locks-newer-than", default="")
    args = parser.parse_args()
    out = {"killed": [], "removed_files": [], "removed_locks": [], "error": ""}
    if not args.shared_dir:
        out["killed"] = end(f"{args.marker}={args.token}")
    else:
        for path in glob.glob(os.path.join(args.shared_dir, f".preflight-*-{args.token}")):
            with contextlib.suppress(OSError):
                os.unlink(path)
                out["removed_files"].append(path)
        if args.locks_newer_than:
            try:
                from trainer.torch_extensions import remove_stale

                removed = remove_stale(newer_than=float(args.locks_newer_than))
                out["removed_locks"] = [lock["path"] for lock in removed]
            except ImportError as err:
                out["error"] = f"cannot look for build locks: {err}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
