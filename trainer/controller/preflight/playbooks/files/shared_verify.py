#!/usr/bin/env python3
"""On the head: check each marker file (exists, owner, content), then remove it. Never fails."""

import argparse
import json
import os
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--names", required=True, help="JSON object: host -> marker file name")
    args = parser.parse_args()
    results = {}
    for host, name in json.loads(args.names).items():
        path = os.path.join(args.dir, name)
        entry = {"path": path, "visible": False, "uid": None, "gid": None, "content_ok": False, "error": ""}
        try:
            info = os.stat(path)
            entry.update(visible=True, uid=info.st_uid, gid=info.st_gid)
            with open(path) as handle:
                entry["content_ok"] = handle.read() == args.token
        except OSError as err:
            entry["error"] = err.strerror or str(err)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as err:
            entry["error"] = (
                entry["error"] + "; " if entry["error"] else ""
            ) + f"cannot remove: {err.strerror}"
        results[host] = entry
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
