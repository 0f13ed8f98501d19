#!/usr/bin/env python3
"""Write a marker file into the shared dir as the training user; print its path, owner and error."""

import argparse
import json
import os
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--token", required=True)
    args = parser.parse_args()
    path = os.path.join(args.dir, args.name)
    out = {"path": path, "uid": os.getuid(), "gid": os.getgid(), "error": ""}
    try:
        with open(path, "w") as handle:
            handle.write(args.token)
            handle.flush()
            # The head must see it through the share: flush to the server, not just the page cache.
            os.fsync(handle.fileno())
    except OSError as err:
        out["error"] = f"{err.strerror}: {path}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
