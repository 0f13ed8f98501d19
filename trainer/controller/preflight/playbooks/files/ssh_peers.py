#!/usr/bin/env python3
"""Try SSH in BatchMode from this node to each peer, as the user running this script.

Host keys must already be pinned: StrictHostKeyChecking=yes, never "no". Prints one JSON object:
{"results": [{"peer", "address", "rc", "stderr"}]}. Never fails.
"""

import argparse
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor


def try_peer(user, name, address, timeout):
    command = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        f"ConnectTimeout={timeout}",
        "-o",
        "NumberOfPasswordPrompts=0",
        f"{user}@{address}",
        "true",
    ]
    try:
        out = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout + 10, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired:
        return {"peer": name, "address": address, "rc": 255, "stderr": "ssh timed out"}
    return {"peer": name, "address": address, "rc": out.returncode, "stderr": out.stderr.strip()[-800:]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--user", required=True)
    parser.add_argument("--peers", required=True, help="JSON list of [name, address]")
    parser.add_argument("--timeout", type=int, default=5)
    args = parser.parse_args()
    peers = json.loads(args.peers)
    if not shutil.which("ssh"):
        print(json.dumps({"error": "no ssh client on this node", "results": []}))
        return 0
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda p: try_peer(args.user, p[0], p[1], args.timeout), peers))
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
