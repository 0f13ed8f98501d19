#!/usr/bin/env python3
"""End what a stopped preflight left on this node. Prints JSON; never fails.

    cleanup.py --marker NAME --token T                       processes whose environment has NAME=T
                                                            (TERM, then KILL): listener, iperf3
    cleanup.py --marker NAME --token T --shared-dir DIR      also its marker files in DIR
               [--locks-newer-than EPOCH]                    and build locks nobody holds made since
                                                            then (a stopped DeepSpeed job's), with
                                                            the training venv's python

Processes are matched by their environment, not their name, so only preflight's own are touched,
and only this account's own: each account's pass ends the processes preflight started as it (the
login's listener and iperf3 servers; the training user's probes), so no account ever signals a
process another account controls (the token is on Ansible's command lines, which `ps` shows to
every account: anyone could tag a process with it). Signals go through a pidfd opened before the
process is read, so a pid reused in between is never signalled.
"""

import argparse
import contextlib
import glob
import json
import os
import signal
import sys
import time


def own_uid(pid):
    """The process's real uid (/proc/PID/status), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def marked(marker):
    """pidfds of this account's processes whose environment holds marker (NAME=TOKEN)."""
    wanted = marker.encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (os.getpid(), os.getppid()):
            continue
        pid = int(entry)
        try:
            pidfd = os.pidfd_open(pid)  # holds this very process from here on
        except OSError:
            continue
        keep = False
        try:
            if own_uid(pid) == os.getuid():
                with open(f"/proc/{entry}/environ", "rb") as handle:
                    keep = wanted in handle.read().split(b"\0")
        except OSError:
            pass
        if keep:
            found[pid] = pidfd
        else:
            os.close(pidfd)
    return found


def end(marker, grace_s=3.0):
    killed = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        found = marked(marker)
        if not found:
            break
        for pid, pidfd in found.items():
            with contextlib.suppress(OSError):
                # The process read above, or nothing (ESRCH) if it ended since: never a reused pid.
                signal.pidfd_send_signal(pidfd, sig)
                killed.append(pid)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in found):
            time.sleep(0.1)
        for pidfd in found.values():
            os.close(pidfd)
    return sorted(set(killed))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--marker", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--shared-dir", default="")
    parser.add_argument("--locks-newer-than", default="")
    args = parser.parse_args()
    out = {"killed": [], "removed_files": [], "removed_locks": [], "error": ""}
    out["killed"] = end(f"{args.marker}={args.token}")
    if args.shared_dir:
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
