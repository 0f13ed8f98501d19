#!/usr/bin/env python3
"""This node's side of the bandwidth check's iperf3 tests: every round of it, or one step.

rounds: the whole schedule of this node (one Ansible task per node for every round: each task costs
the controller per node, so a task per round was the check's cost at scale). Step by step, in round
order, it serves (the `server` step below, run as a child; it waits until that server's one test
is over, then ends it) or measures (the `client` step, which tries to connect until its server
listens). No clock keeps the rounds in step: a node starts its round when its previous one is over,
and a client waits for its server, so each pair meets as soon as both ends are free. Each round has
a port of its own, so a client running ahead never takes a server meant for another round's client.

server: `iperf3 -s -1` bound to this node's cluster address on a comm-range port, started as a child
in its own session (it outlives this script) and reported started only once it listens; it exits
after one test. It prints its pid and start time; `rounds` waits for that server's test, then ends
it with `stop`, which kills that process only if it still is that server (same start time, iperf3,
this account's): no pidfile, so nothing another account can plant in a shared temp dir decides what
gets signalled, and nodes that share /tmp do not collide. `rounds` prints, as `started`, any server
that outlived that (none unless a kill did not take: a preflight stopped midway is cleaned up by the
marker in every probe's environment, cleanup.yml). client:
`iperf3 -c --bidir -J`, retried every CONNECT_RETRY_S until its server listens (up to PEER_WITHIN_S
in `rounds`). Prints JSON; never fails.

reach (the first thing `rounds` does, with --reach): before any test, this node listens on a comm-range
port of its own and opens a TCP connection to each peer it has a test with, on that peer's; each
connection carries the opener's name. A connect that gets no answer (a firewall that drops new
connections from this node: ufw's `deny`) is tried twice and called dropped in seconds; a refused one
(the peer not listening yet, or a firewall's `reject`) is tried until REACH_WITHIN_S. A pair that
did not connect both ways is not tested: a one-off server would wait out a client that can never
reach it, and every later round of both nodes behind it (a blocked link cost the probe pass two
minutes, and healthy pairs after it failed). Each side says which way was blocked.
"""

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
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
#: How long a client of `rounds` keeps trying to connect: its server's node may still be in its own
#: previous round, or (the first round) its task may have started later, Ansible starting one node's
#: task after another. Only a pair that fails waits this long.
PEER_WITHIN_S = 60
#: Pause between a refused client's tries.
CONNECT_RETRY_S = 0.2
#: How long the reach pass waits for its peers: their tasks start about when this one does (one fork
#: per node), give or take the controller's pace starting them.
REACH_WITHIN_S = 20
#: A reach connect with no answer in this long is dropped; one answered is answered at once.
REACH_CONNECT_TIMEOUT_S = 2


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
    # The server starts on another node at about the same time: try to connect until it has had its
    # time to listen.
    deadline = time.monotonic() + args.connect_within
    while True:
        rc, out, err = run(command, args.seconds + 30)
        try:
            result = json.loads(out) if out.strip() else {"error": err.strip() or f"iperf3 exited {rc}"}
        except ValueError:
            result = {"error": (err or out).strip()[-400:]}
        refused = "unable to connect" in str(result.get("error", ""))
        if rc == 127 or not refused or time.monotonic() > deadline:
            break
        # Each try is one short iperf3 client refused at once: try often, so a pair meets soon after
        # its server listens (a round lasts about a second of test).
        time.sleep(CONNECT_RETRY_S)
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


def wait_for_test(server, seconds):
    """Until the server's one test is over (the one-off server exits) or its client is late past
    every bound (it never came: the pair failed on the client's side); then end it, if still ours."""
    deadline = time.monotonic() + LISTEN_WITHIN_S + PEER_WITHIN_S + seconds + 30
    while time.monotonic() < deadline and still_our_server(server["pid"], server["start_time"]):
        time.sleep(0.1)
    return stop(argparse.Namespace(pid=server["pid"], start_time=server["start_time"]))


def reach(spec):
    """{peer: {"out": how this node's connection to it went, "in": whether it connected here}} for
    every peer of spec (--reach: {name, port, bind, peers: [[name, address]]})."""
    name, port, peers = spec["name"], int(spec["port"]), dict(spec["peers"])
    arrived, out = set(), {}
    deadline = time.monotonic() + REACH_WITHIN_S
    try:
        listener = socket.create_server((spec["bind"], port))
    except OSError:
        return {}  # no reach pass (the port is taken here): every pair is tested, as before it
    listener.settimeout(0.2)

    def accept():
        while time.monotonic() < deadline and not set(peers) <= arrived:
            try:
                connection, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            with connection:
                connection.settimeout(REACH_CONNECT_TIMEOUT_S)
                with contextlib.suppress(OSError):
                    arrived.add(connection.recv(256).decode(errors="replace").strip())

    def connect(peer, address):
        tries_unanswered = 0
        while True:
            try:
                with socket.create_connection(
                    (address, port), timeout=REACH_CONNECT_TIMEOUT_S, source_address=(spec["bind"], 0)
                ) as connection:
                    connection.sendall(name.encode())
                out[peer] = "ok"
                return
            except TimeoutError:
                tries_unanswered += 1
                if tries_unanswered >= 2 or time.monotonic() > deadline:
                    out[peer] = f"no answer within {REACH_CONNECT_TIMEOUT_S} s, twice (dropped)"
                    return
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    out[peer] = f"refused for {REACH_WITHIN_S} s"
                    return
                time.sleep(CONNECT_RETRY_S)
            except OSError as err:
                out[peer] = err.strerror or str(err)
                return

    threads = [threading.Thread(target=accept)]
    threads += [threading.Thread(target=connect, args=item) for item in peers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    listener.close()
    return {peer: {"out": out.get(peer, "not tried"), "in": peer in arrived} for peer in peers}


def blocked(peer, reached, me, port):
    """Why the pair with `peer` is not tested (which way did not connect), or None."""
    found = reached.get(peer)
    if found is None:
        return None
    ways = []
    if found["out"] != "ok":
        ways.append(f"{me} cannot open a connection to {peer} on port {port} ({found['out']})")
    if not found["in"]:
        ways.append(f"{peer} did not open a connection to {me} on port {port} within {REACH_WITHIN_S} s")
    return "; ".join(ways) + "; not measured" if ways else None


def rounds(args):
    """Every step of this node's schedule (--plan, round order), each over before the next starts;
    first the reach pass (--reach), and no test of a pair that did not connect both ways."""
    servers, clients = [], []
    began = time.monotonic()
    spec = json.loads(args.reach or "{}")
    reached = reach(spec) if spec else {}
    reach_s = round(time.monotonic() - began, 2)
    for step in json.loads(args.plan):
        peer = step.get("peer_name")  # the other end: the server's, or (a server step) its client's
        why = blocked(peer, reached, spec.get("name"), spec.get("port"))
        if why and step["role"] == "server":
            servers.append({"started": False, "skipped": True, "error": why, "round": step["round"]})
            continue
        if why:
            skipped = {"peer": step["peer"], "port": step["port"], "error": why, "end": {}}
            clients.append({**skipped, "round": step["round"], "peer_name": peer, "at_s": 0.0, "took_s": 0.0})
            continue
        # When each step started and how long it took: where a slow check spent its time.
        step_began = time.monotonic()
        if step["role"] == "server":
            # The `server` step as a child: the one way a server is started, and it returns once the
            # server listens (or with why it did not), the server in a session of its own.
            command = [sys.executable, os.path.abspath(__file__), "server", "--round", str(step["round"])]
            rc, out, err = run([*command, "--port", str(step["port"]), "--bind", step["bind"]], 60)
            try:
                started = json.loads(out.splitlines()[-1])
            except (ValueError, IndexError):
                started = {"started": False, "error": f"the server step failed ({rc}): {err.strip()[-400:]}"}
            if started.get("started"):
                started["stopped"] = wait_for_test(started, args.seconds)["stopped"]
            servers.append({**started, "round": step["round"], **_timed(began, step_began)})
        else:
            step_args = argparse.Namespace(
                peer=step["peer"], port=step["port"], seconds=args.seconds, connect_within=PEER_WITHIN_S
            )
            measured = client(step_args)
            clients.append(
                {
                    **measured,
                    "round": step["round"],
                    "peer_name": step["peer_name"],
                    **_timed(began, step_began),
                }
            )
    # [pid, start_time] of each server that outlived its round's own stop (none, unless a kill did not
    # take): `stop --servers` takes this list. The playbook has no stop task: each server is ended
    # here, and a stop task skipped on every node still cost the controller a task per node.
    alive = [s for s in servers if s.get("pid") and still_our_server(s["pid"], s["start_time"])]
    started = [[s["pid"], s["start_time"]] for s in alive]
    return {"servers": servers, "clients": clients, "started": started, "reach": reached, "reach_s": reach_s}


def _timed(began, step_began):
    return {"at_s": round(step_began - began, 2), "took_s": round(time.monotonic() - step_began, 2)}


def stop_all(args):
    """stop for each [pid, start_time] in --servers (what `rounds` printed): a backstop, as `rounds`
    ends each of its servers after its round."""
    ended = [
        stop(argparse.Namespace(pid=pid, start_time=started)) for pid, started in json.loads(args.servers)
    ]
    return {"stopped": any(e["stopped"] for e in ended)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("rounds", "server", "client", "stop"))
    parser.add_argument("--plan", default="[]", help="rounds: [{round, role, port, bind | peer, peer_name}]")
    parser.add_argument("--round", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--bind", default="")
    parser.add_argument("--peer", default="")
    parser.add_argument("--peer-name", default="")
    parser.add_argument("--seconds", type=int, default=3)
    parser.add_argument("--pid", type=int, default=0, help="stop: the pid the server step printed")
    parser.add_argument("--start-time", type=int, default=-1, help="stop: the start time it printed")
    parser.add_argument("--servers", default="", help="stop: [[pid, start_time], ...] that `rounds` printed")
    parser.add_argument("--reach", default="", help="rounds: {name, port, bind, peers: [[name, address]]}")
    parser.add_argument("--connect-within", type=float, default=LISTEN_WITHIN_S + 5, help="client: seconds")
    args = parser.parse_args()
    if args.role == "stop" and args.servers:
        out = stop_all(args)
    else:
        out = {"rounds": rounds, "server": server, "client": client, "stop": stop}[args.role](args)
    out.update(role=args.role, round=args.round, peer_name=args.peer_name)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
