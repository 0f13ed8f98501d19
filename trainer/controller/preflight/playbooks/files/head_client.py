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
    parser.add_argument("--master-is-ours", action="store_true", help="preflight's listener holds it")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=5.0)
    args = parser.parse_args()

    master_sock, master_error = connect(args.address, args.master_port, args.timeout)
    if master_sock is not None:
        master_sock.close()
    # Clock samples through the clock port (always preflight's own listener); through the master
    # port only when preflight holds it too, since a stranger there would never answer.
    clock = {"samples": [], "via": None, "error": ""}
    candidates = [args.clock_port] if args.clock_port else []
    if args.master_is_ours:
        candidates.append(args.master_port)
    for port in candidates:
        sock, error = connect(args.address, port, args.timeout)
        if sock is None:
            clock["error"] = error
            continue
        try:
            clock.update(samples=samples(sock, args.samples), via=port, error="")
            break
        except (OSError, ValueError) as err:
            clock["error"] = str(err)
        finally:
            sock.close()
    if not candidates:
        clock["error"] = "the head has no listener for the clock check"
    master = {"connected": master_sock is not None, "error": master_error}
    print(json.dumps({"master_port": master, "clock": clock}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
