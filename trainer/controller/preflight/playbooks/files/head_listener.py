#!/usr/bin/env python3
"""Open short-lived listeners on the head for the master-port and clock checks, then detach.

Listens on the master port only if it is free (a port in use is itself a finding: a leftover
trainer would make the launch fail), and on a clock port from the cluster comm range. Each
connection gets the head's time.time() for every line it sends. The listener exits by itself after
--lifetime seconds, so nothing stays open if the controller dies; preflight kills it sooner.
Prints {"pid", "master_port": {"port", "listening", "error"}, "clock_port"} and returns at once.
"""

import argparse
import errno
import json
import os
import selectors
import socket
import sys
import time


def bind(address, port):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # As torch's TCPStore (the rendezvous) does: sockets of a finished job still in TIME_WAIT do
    # not hold the port, so they must not count as "in use" here either.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def serve(listeners, lifetime):
    selector = selectors.DefaultSelector()
    for sock in listeners:
        selector.register(sock, selectors.EVENT_READ, "listen")
    deadline = time.monotonic() + lifetime
    while time.monotonic() < deadline:
        for key, _ in selector.select(timeout=1.0):
            if key.data == "listen":
                conn, _ = key.fileobj.accept()
                conn.setblocking(False)
                selector.register(conn, selectors.EVENT_READ, "conn")
                continue
            try:
                chunk = key.fileobj.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                selector.unregister(key.fileobj)
                key.fileobj.close()
                continue
            # One timestamp per request line; take the time as late as possible.
            replies = b"".join(repr(time.time()).encode() + b"\n" for _ in range(chunk.count(b"\n")))
            try:
                key.fileobj.sendall(replies)
            except OSError:
                selector.unregister(key.fileobj)
                key.fileobj.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True, help="the head's cluster address (not 0.0.0.0)")
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--clock-ports", required=True, help="low:high range to pick the clock port from")
    parser.add_argument("--lifetime", type=int, default=120)
    args = parser.parse_args()

    listeners = []
    master = {"port": args.master_port, "listening": False, "error": ""}
    try:
        listeners.append(bind(args.address, args.master_port))
        master["listening"] = True
    except OSError as err:
        master["error"] = "in use" if err.errno == errno.EADDRINUSE else str(err)

    low, high = (int(p) for p in args.clock_ports.split(":"))
    clock_port = None
    for port in range(high, low - 1, -1):
        if port == args.master_port:
            continue
        try:
            listeners.append(bind(args.address, port))
        except OSError:
            continue
        clock_port = port
        break

    pid = os.fork()
    if pid:
        print(json.dumps({"pid": pid, "master_port": master, "clock_port": clock_port}))
        return 0
    # Child: detach from the Ansible session so the task can return while it listens.
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        serve(listeners, args.lifetime)
    finally:
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
