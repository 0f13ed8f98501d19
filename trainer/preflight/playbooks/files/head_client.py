#!/usr/bin/env python3
"""From a worker: connect to the head's master port, and take clock samples from the head.

Prints {"master_port": {"connected", "error"}, "clock": {"samples": [[sent, head, received]], "via",
"error"}}. Never fails.
"""

import argparse
import json
import socket
import sys
import time


def connect(address, port, timeout):
    try:
        return socket.create_connection((address, port), timeout=timeout), ""
    except OSError as err:
        return None, err.strerror or str(err)


def samples(sock, count):
    taken = []
    reader = sock.makefile("rb")
    for _ in range(count):
        sent = time.time()
        sock.sendall(b"t\n")
        line = reader.readline()
        received = time.time()
        if not line:
            break
        taken.append([sent, float(line), received])
    return taken


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--clock-port", type=int, default=0)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()

    master_sock, master_error = connect(args.address, args.master_port, args.timeout)
    clock = {"samples": [], "via": None, "error": ""}
    sock, via = master_sock, args.master_port
    if sock is None and args.clock_port:
        sock, clock["error"] = connect(args.address, args.clock_port, args.timeout)
        via = args.clock_port
    if sock is not None:
        try:
            clock["samples"], clock["via"] = samples(sock, args.samples), via
        except (OSError, ValueError) as err:
            clock["error"] = str(err)
        finally:
            sock.close()
    elif not clock["error"]:
        clock["error"] = master_error
    print(
        json.dumps(
            {"master_port": {"connected": master_sock is not None, "error": master_error}, "clock": clock}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
