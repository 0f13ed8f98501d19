#!/usr/bin/env python3
"""SSH ProxyCommand into the VM test bed's network namespace.

The VMs' QEMU processes live in a network namespace the test creates (their private multicast
segment must not touch the host's routes), so their SSH port forwards listen on 127.0.0.1 inside
that namespace. ssh runs this under `ip netns exec NS`: it connects to HOST:PORT there and copies
bytes between the connection and stdin/stdout. Host keys are still checked by ssh itself.

Usage (ssh_config): ProxyCommand ip netns exec clustertrain-vm python3 netns-relay.py %h %p
"""

import os
import selectors
import socket
import sys


def main() -> int:
    host, port = sys.argv[1], int(sys.argv[2])
    try:
        conn = socket.create_connection((host, port), timeout=10)
    except OSError as exc:
        print(f"netns-relay: cannot connect to {host}:{port}: {exc}", file=sys.stderr)
        return 1
    conn.settimeout(None)
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    selector = selectors.DefaultSelector()
    selector.register(stdin, selectors.EVENT_READ)
    selector.register(conn, selectors.EVENT_READ)
    open_sides = 2
    while open_sides:
        for key, _ in selector.select():
            if key.fileobj == stdin:
                data = os.read(stdin, 65536)
                if data:
                    conn.sendall(data)
                else:  # ssh closed its side: pass the half-close on
                    selector.unregister(stdin)
                    conn.shutdown(socket.SHUT_WR)
                    open_sides -= 1
            else:
                data = conn.recv(65536)
                if not data:
                    return 0
                while data:  # a pipe may take less than the whole buffer
                    data = data[os.write(stdout, data) :]
    return 0


if __name__ == "__main__":
    sys.exit(main())
