#!/usr/bin/env python3
"""One side of one iperf3 test: start a one-off server, or run the client against it.

server: `iperf3 -s -1 -D` bound to this node's cluster address on a comm-range port; it exits after
one test, and `stop` kills it if the client never came. client: `iperf3 -c --bidir -J`, retried
briefly in case the server is still starting. Prints JSON; never fails.
"""

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time


def run(command, timeout):
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        return out.returncode, out.stdout, out.stderr
    except FileNotFoundError:
        return 127, "", "iperf3 is not installed on this node"
    except subprocess.TimeoutExpired:
        return 124, "", f"{command[0]} timed out after {timeout} s"


def server(args):
    rc, _, err = run(
        ["iperf3", "-s", "-1", "-D", "-B", args.bind, "-p", str(args.port), "-I", args.pidfile], 15
    )
    return {"started": rc == 0, "error": err.strip()[-400:] if rc else ""}


def client(args):
    command = [
        "iperf3",
        "-c",
        args.peer,
        "-p",
        str(args.port),
        "-J",
        "--bidir",
        "-t",
        str(args.seconds),
        "--connect-timeout",
        "3000",
    ]
    for attempt in range(5):
        rc, out, err = run(command, args.seconds + 30)
        try:
            result = json.loads(out) if out.strip() else {"error": err.strip() or f"iperf3 exited {rc}"}
        except ValueError:
            result = {"error": (err or out).strip()[-400:]}
        if rc == 127 or "unable to connect" not in str(result.get("error", "")) or attempt == 4:
            break
        time.sleep(1)
    end = result.get("end", {})
    # Keep only the summary: the per-interval data would bloat the event stream.
    keep = {k: end[k] for k in ("sum_received", "sum_received_bidir_reverse", "sum_sent") if k in end}
    return {"peer": args.peer, "port": args.port, "error": result.get("error", ""), "end": keep}


def stop(args):
    try:
        with open(args.pidfile) as handle:
            os.kill(int(handle.read().strip()), signal.SIGTERM)
        stopped = True
    except (OSError, ValueError):
        stopped = False  # Already gone: the one-off server exits after its test.
    with contextlib.suppress(OSError):
        os.unlink(args.pidfile)
    return {"stopped": stopped}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("server", "client", "stop"))
    parser.add_argument("--round", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--bind", default="")
    parser.add_argument("--peer", default="")
    parser.add_argument("--peer-name", default="")
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--pidfile", default="/tmp/preflight-iperf3.pid")
    args = parser.parse_args()
    out = {"server": server, "client": client, "stop": stop}[args.role](args)
    out.update(role=args.role, round=args.round, peer_name=args.peer_name)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
