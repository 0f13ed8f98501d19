#!/usr/bin/env python3
"""One side of one iperf3 test: start a one-off server, or run the client against it.

server: `iperf3 -s -1` bound to this node's cluster address on a comm-range port, started as a child
in its own session (it outlives this script) and reported started only once it listens; it exits
after one test. It prints its pid and start time, which the playbook hands to `stop`, and `stop`
kills that process only if it still is that server (same start time, iperf3, this account's): no
pidfile, so nothing another account can plant in a shared temp dir decides what gets signalled,
and nodes that share /tmp do not collide. client: `iperf3 -c --bidir -J`, retried briefly in case
the server is still starting (it starts in the same task). Prints JSON; never fails.
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time


def run(command, timeout):
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        return out.returncode, out.stdout, out.stderr
    except FileNotFoundError:
        return 127, "", "iperf3 is not installed on this node"
    except subprocess.TimeoutExpired:
        return 124, "", f"{command[0]} timed out after {timeout} s"


#: How long a server may take to listen before it counts as not started.
LISTEN_WITHIN_S = 15


def start_time(pid):
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat): with the pid,
    it names one process for the whole uptime, so a reused pid is never mistaken for the server."""
    with open(f"/proc/{pid}/stat") as handle:
        # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
        return int(handle.read().rsplit(")", 1)[1].split()[19])


def server(args):
    # Not `-D`: a daemon's bind error goes nowhere and its parent exits 0 anyway, so a server that
    # never listened was reported started. As our child we see it listen or see it die, and why.
    # Its output goes to a nameless file (O_TMPFILE), which no other account can open or replace.
    with tempfile.TemporaryFile() as log:  # closing our copy leaves the server's open
        return _start_server(args, log)


def _start_server(args, log):
    command = ["iperf3", "-s", "-1", "--forceflush", "-B", args.bind, "-p", str(args.port)]
    try:
        # A session of its own: the server outlives this script and Ansible's connection to the node.
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    except FileNotFoundError:
        return {"started": False, "error": "iperf3 is not installed on this node"}
    deadline = time.monotonic() + LISTEN_WITHIN_S
    while True:
        code = proc.poll()
        said = os.pread(log.fileno(), 65536, 0).decode(errors="replace")
        if code is not None:
            why = " ".join(said.split())[-400:] or "no output"
            return {"started": False, "error": f"the iperf3 server exited ({code}) before it listened: {why}"}
        if "Server listening" in said:
            return {"started": True, "error": "", "pid": proc.pid, "start_time": start_time(proc.pid)}
        if time.monotonic() > deadline:
            proc.kill()  # our own child, not yet reaped: this pid cannot be anyone else's
            proc.wait()
            return {"started": False, "error": f"the iperf3 server did not listen within {LISTEN_WITHIN_S} s"}
        time.sleep(0.05)


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
    # The server starts in the same task as this client (one task per round): try to connect until
    # it has had its time to listen.
    deadline = time.monotonic() + LISTEN_WITHIN_S + 5
    while True:
        rc, out, err = run(command, args.seconds + 30)
        try:
            result = json.loads(out) if out.strip() else {"error": err.strip() or f"iperf3 exited {rc}"}
        except ValueError:
            result = {"error": (err or out).strip()[-400:]}
        refused = "unable to connect" in str(result.get("error", ""))
        if rc == 127 or not refused or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    end = result.get("end", {})
    # Keep only the summary: the per-interval data would bloat the event stream.
    keep = {k: end[k] for k in ("sum_received", "sum_received_bidir_reverse", "sum_sent") if k in end}
    return {"peer": args.peer, "port": args.port, "error": result.get("error", ""), "end": keep}


def still_our_server(pid, started):
    """Whether pid is still the server this round started: same start time, the iperf3 program,
    and this account's. Only then may stop signal it."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            uid = next(int(line.split()[1]) for line in handle if line.startswith("Uid:"))
        program = os.readlink(f"/proc/{pid}/exe")
        return (
            start_time(pid) == started
            and uid == os.getuid()
            and program == os.path.realpath(shutil.which("iperf3") or "iperf3")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return False  # gone (the one-off server exits after its test) or not readable: not ours


def stop(args):
    # The pid comes from this round's server step (through the playbook), never from a file; a
    # positive pid only, so never a process group.
    if args.pid <= 1 or not still_our_server(args.pid, args.start_time):
        return {"stopped": False}  # already gone: the one-off server exits after its test
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not still_our_server(args.pid, args.start_time):
            break
        with contextlib.suppress(OSError):
            os.kill(args.pid, sig)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and still_our_server(args.pid, args.start_time):
            time.sleep(0.05)
    return {"stopped": True}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("server", "client", "stop"))
    parser.add_argument("--round", type=int, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--bind", default="")
    parser.add_argument("--peer", default="")
    parser.add_argument("--peer-name", default="")
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--pid", type=int, default=0, help="stop: the pid the server step printed")
    parser.add_argument("--start-time", type=int, default=-1, help="stop: the start time it printed")
    args = parser.parse_args()
    out = {"server": server, "client": client, "stop": stop}[args.role](args)
    out.update(role=args.role, round=args.round, peer_name=args.peer_name)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
