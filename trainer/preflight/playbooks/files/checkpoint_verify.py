#!/usr/bin/env python3
"""On the head: did the run's checkpoint land? Read checkpoints/latest, list the step dir, then
remove the run dir when it is complete (it is preflight's own scratch run). Never fails."""

import argparse
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
    if out["files"] and not out["error"]:
        shutil.rmtree(args.run_dir, ignore_errors=True)
        out["removed"] = not os.path.exists(args.run_dir)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
