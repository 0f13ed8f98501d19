#!/usr/bin/env python3
"""On the head: did the run's checkpoint land? Read checkpoints/latest, list the step dir, then
remove the run dir when it is complete (it is preflight's own scratch run). Never fails."""

import argparse
import glob
import json
import os
import shutil
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args()
    checkpoints = os.path.join(args.run_dir, "checkpoints")
    out = {"run_dir": args.run_dir, "latest": None, "files": 0, "bytes": 0, "uid": None, "error": ""}
    try:
        with open(os.path.join(checkpoints, "latest")) as handle:
            out["latest"] = handle.read().strip()
        step_dir = os.path.join(checkpoints, out["latest"])
        out["uid"] = os.stat(step_dir).st_uid
        for root, _, files in os.walk(step_dir):
            for name in files:
                out["files"] += 1
                out["bytes"] += os.path.getsize(os.path.join(root, name))
    except OSError as err:
        out["error"] = f"{err.strerror}: {err.filename}"
    # Why a failed job failed: the error lines of each node's log (the launcher keeps them in launch/).
    out["node_errors"] = {}
    for log in sorted(glob.glob(os.path.join(args.run_dir, "launch", "*", "log"))):
        try:
            with open(log, errors="replace") as handle:
                lines = [ln.strip() for ln in handle if "Error" in ln and not ln.startswith((" ", "\t"))]
        except OSError:
            continue
        if lines:
            out["node_errors"][os.path.basename(os.path.dirname(log))] = list(dict.fromkeys(lines))[-3:]
    if out["files"] and not out["error"]:
        shutil.rmtree(args.run_dir, ignore_errors=True)
        out["removed"] = not os.path.exists(args.run_dir)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
