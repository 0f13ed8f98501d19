"""Launch overhead: `trainer launch` against the seed guide's way (torchrun by hand on each host).

Both start the same job (1 process per node, gloo, the embedded default) and are timed from the
command to the first logged step of rank 0 on the screen. The launcher's time includes everything
it adds: its own start, the plan, ansible-runner and ansible-playbook, the probe and start round
trips, and the poll that brings the step line to the screen. Rounds are interleaved (launcher, by
hand, by hand, launcher, ...) so a machine whose load drifts weighs on both alike; the medians are
compared, with the time the command printed its first line (its own start-up). One more launch, in
this process, is taken apart by phase, the last one at the moment rank 0's log got the step line
(the log's mtime: the trainer's start-up before it, the watch's poll after it).

Where: two loopback "hosts" on this machine, always; and the Molecule test bed (ct-head,
ct-worker1, ct-worker2: 3 nodes) too when /tmp/clustertrain-testbed.status says `up` (--loopback:
loopback only). Prints seconds, the overhead and the ratio for each, in one run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers.testbed_nodes import cluster_settings  # noqa: E402 - the bed tests' helpers

TESTBED_INVENTORY = REPO / "molecule" / "default" / "inventory"
STATUS = Path("/tmp/clustertrain-testbed.status")
STEP = re.compile(r"^step (\d+)/(\d+)")
#: A run (6 tiny steps) still running this long after its first step is hung, not slow.
RUN_TIMEOUT_S = 120.0
TRAIN_SETS = ["train.max_steps=6", "train.warmup_steps=1", "train.log_every=1", "checkpoint.save_steps=0"]


def testbed_up() -> bool:
    try:
        return STATUS.read_text().split()[0] == "up"
    except (OSError, IndexError):
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_inventory(workdir: Path, loopback: bool, hosts: int, port: int) -> tuple[Path, list[dict]]:
    """An inventory of `hosts` nodes with 1 process each; returns it and the nodes (name, address)."""
    inventory = workdir / "inventory"
    if loopback:
        local = {
            "ansible_connection": "local",
            "ansible_python_interpreter": "{{ ansible_playbook_python }}",
            "cluster_accelerators": 0,
        }
        names = [f"node{i}" for i in range(hosts)]
        # Each host its own loopback address (the inventory's rules refuse two hosts on one).
        addresses = {n: f"127.0.0.{i + 1}" for i, n in enumerate(names)}
        tree = {
            "cluster": {
                "children": {
                    "head": {"hosts": {names[0]: dict(local, cluster_ip=addresses[names[0]])}},
                    "workers": {"hosts": {n: dict(local, cluster_ip=addresses[n]) for n in names[1:]}},
                }
            }
        }
        (inventory / "group_vars" / "cluster").mkdir(parents=True)
        (inventory / "hosts.yml").write_text(yaml.safe_dump(tree, sort_keys=False))
        user = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
        settings = {
            "cluster_training_user": user,
            "cluster_shared_dir": str(workdir / "shared"),
            "training_venv": str(REPO / ".venv"),
            "cluster_nccl_socket_ifname": "auto",
        }
        nodes = [{"name": n, "address": addresses[n]} for n in names]
    else:
        shutil.copytree(TESTBED_INVENTORY, inventory)
        tree = yaml.safe_load((inventory / "hosts.yml").read_text())
        children = tree["cluster"]["children"]
        head = next(iter(children["head"]["hosts"]))
        workers = list(children["workers"]["hosts"])[: hosts - 1]
        children["workers"]["hosts"] = {w: children["workers"]["hosts"][w] for w in workers}
        (inventory / "hosts.yml").write_text(yaml.safe_dump(tree, sort_keys=False))
        settings = {}
        every = {**children["head"]["hosts"], **children["workers"]["hosts"]}
        nodes = [{"name": n, "address": every[n]["cluster_ip"]} for n in [head, *workers]]
    settings.update({"training_procs_per_node": 1, "cluster_master_port": port, "training_engine": "ddp"})
    (inventory / "group_vars" / "cluster" / "zz_bench.yml").write_text(yaml.safe_dump(settings))
    return inventory, nodes


def _drain(stream: Any, into: list[str]) -> threading.Thread:
    """Read the rest of a process's output on a thread (so that waiting for it can time out)."""
    thread = threading.Thread(target=lambda: into.extend(stream), daemon=True)
    thread.start()
    return thread


def _wait_all(procs: list[subprocess.Popen], what: str) -> list[int] | None:
    """Exit codes, or None when a process had not ended RUN_TIMEOUT_S after the step was seen: then
    every one is stopped (SIGINT first: the launcher's Ctrl-C stops its nodes) and it is said so. The
    time to the first step stands; a rank hung in its teardown must not stall the whole bench."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        return [proc.wait(max(1.0, deadline - time.monotonic())) for proc in procs]
    except subprocess.TimeoutExpired:
        pass
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    print(f"  ({what}: still running {RUN_TIMEOUT_S:.0f} s after its first step, stopped)", file=sys.stderr)
    return None


def time_launcher(inventory: Path, run_name: str, launch_dir: Path) -> tuple[float, float, float]:
    """Seconds to the first step on the screen, to the command's first line (its own start-up:
    interpreter, imports, inventory and plan), and to the start of the last node's run.sh (its `pid`
    file, written first thing): what the launcher adds before the trainers run, free of their start-up."""
    sets = [arg for item in TRAIN_SETS for arg in ("--set", item)]
    command = [sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--run-name", run_name, *sets]
    wall_started = time.time()
    started = time.monotonic()
    first = first_line = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        output = []
        for line in proc.stdout:
            output.append(line)
            if first_line is None:
                first_line = time.monotonic() - started
            if STEP.match(line):
                first = time.monotonic() - started
                break
        drain = _drain(proc.stdout, output)
        codes = _wait_all([proc], "trainer launch")
        drain.join()
    pids = list(launch_dir.glob("node-*/pid"))
    if (codes is not None and codes != [0]) or first is None or first_line is None or not pids:
        raise SystemExit(
            f"trainer launch failed (exit {proc.returncode}) or logged no step:\n{''.join(output[-30:])}"
        )
    return first, first_line, max(path.stat().st_mtime for path in pids) - wall_started


def by_hand_command(loopback: bool, node: dict, env: dict[str, str], venv: str) -> list[str]:
    """What the seed guide has the user type on each host: export the variables, run torchrun."""
    torchrun = [
        f"{venv}/bin/torchrun",
        f"--nnodes={env['NNODES']}",
        "--nproc-per-node=1",
        f"--node-rank={env['NODE_RANK']}",
        f"--master-addr={env['MASTER_ADDR']}",
        f"--master-port={env['MASTER_PORT']}",
        "--no-python",
        f"{venv}/bin/trainer",
        "train",
        *[arg for item in [*TRAIN_SETS, f"output_dir={env['OUTPUT_DIR']}"] for arg in ("--set", item)],
    ]
    if loopback:
        return torchrun
    exports = [f"{k}={v}" for k, v in env.items()]
    return ["podman", "exec", "-u", "trainer", "-w", "/tmp", node["name"], "env", *exports, *torchrun]


def time_by_hand(loopback: bool, nodes: list[dict], port: int, output_dir: str, venv: str) -> float:
    procs = []
    started = time.monotonic()
    first = None
    environment = dict(os.environ, PYTHONUNBUFFERED="1")
    if not loopback:
        environment["CONTAINERS_CONF"] = str(REPO / "scripts" / "testbed" / "containers.conf")
    for rank, node in enumerate(nodes):
        env = {
            "NNODES": str(len(nodes)),
            "NODE_RANK": str(rank),
            "MASTER_ADDR": nodes[0]["address"],
            "MASTER_PORT": str(port),
            "OUTPUT_DIR": output_dir,
            "PYTHONUNBUFFERED": "1",
        }
        command = by_hand_command(loopback, node, env, venv)
        procs.append(
            subprocess.Popen(
                command,
                stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                text=True,
                env=environment,
            )
        )
    for line in procs[0].stdout:
        if STEP.match(line):
            first = time.monotonic() - started
            break
    drain = _drain(procs[0].stdout, [])
    codes = _wait_all(procs, "torchrun by hand")
    drain.join()
    if (codes is not None and any(codes)) or first is None:
        raise SystemExit(f"torchrun by hand failed (exit codes {codes}) or logged no step")
    return first


def phases(inventory: Path, run_name: str) -> list[tuple[str, float]]:
    """One launch in this process, taken apart: seconds from the start to each milestone."""
    started = time.monotonic()
    # A second place loads a second inventory in this process: Ansible says so once; it is harmless.
    warnings.filterwarnings("ignore", "AnsibleCollectionFinder has already been configured")
    from trainer.controller.inventory import load_cluster
    from trainer.controller.launcher.attempt_events import start_word
    from trainer.controller.launcher.launch import Launcher
    from trainer.controller.launcher.launch_cli import prestart
    from trainer.controller.launcher.plan import make_plan
    from trainer.controller.launcher.wire import WatchOptions

    marks = [("imports", time.monotonic() - started)]
    # As `trainer launch` does: ansible-playbook starts while the plan is made.
    early = prestart(argparse.Namespace(inventory=str(inventory), command=[]))
    marks.append(("ansible-playbook spawned (it starts while the plan is made)", time.monotonic() - started))
    plan = make_plan(load_cluster(inventory), None, tuple(TRAIN_SETS), None, run_name)
    marks.append(("plan (inventory, trainer config)", time.monotonic() - started))
    launcher = Launcher(plan, WatchOptions(), prestarted=early)
    seen: set[str] = set()

    def mark(name: str) -> None:
        if name not in seen:
            seen.add(name)
            marks.append((name, time.monotonic() - started))

    waiting: list = []
    started_hosts: set[str] = set()

    def on_event(event: dict) -> None:
        name = event.get("event")
        if name == "playbook_on_start":
            mark("ansible-playbook started (its imports, inventory, playbook)")

    class FirstStep(Exception):
        pass

    wall_started = time.time() - (time.monotonic() - started)
    head_log = Path(plan.launch_dir) / "node-0" / "log"

    probed: set[str] = set()
    nodes = {n.host for n in plan.topology.nodes}

    def on_message(message: dict) -> None:
        # attempt_events.StartHandshake answers the probes (its word to start); here, as there, once all
        # have passed. The bench reads no failure: a node that fails its probe ends the run.
        if message.get("type") == "probed":
            probed.add(str(message.get("host")))
            if probed >= nodes:
                mark("probe on every node")
                word = start_word([m.get("answer") or {} for m in [*waiting, message]])
                for held in [*waiting, message]:
                    held.reply(word)
                waiting.clear()
            else:
                waiting.append(message)
            return
        if message.get("type") == "started":
            started_hosts.add(str(message.get("host")))
            if started_hosts >= nodes:
                mark("files written, trainer started on every node")
        report = message.get("report") or {}
        if message.get("host") != plan.topology.head.host:
            return
        for line in report.get("lines") or []:
            if STEP.match(line):
                # Rank 0's log (the shared dir is this machine's, on loopback and on the bed): when it
                # has not grown since this answer, its mtime is when the step line was written.
                try:
                    written = head_log.stat()
                except OSError:
                    written = None
                if written is not None and written.st_size == report.get("offset"):
                    marks.append(
                        ("first step written on the node (trainer start-up)", written.st_mtime - wall_started)
                    )
                mark("first step shown (the watch's poll)")
                raise FirstStep

    extravars = launcher.extravars(launch_files=launcher.files, launch_info=launcher.record().to_json())
    try:
        launcher._run("start.yml", extravars, on_event=on_event, on_message=on_message)
    except (FirstStep, KeyboardInterrupt):
        pass
    finally:
        launcher.stop()
        if early is not None:
            early.cancel()  # ends it if the launch did not take it; after that, nothing
    return marks


def measure(where: str, loopback: bool, hosts: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        workdir = Path(tmp)
        port = free_port() if loopback else 29531
        inventory, nodes = make_inventory(workdir, loopback, hosts=hosts, port=port)
        settings = cluster_settings(inventory)
        shared = str(workdir / "shared") if loopback else settings["cluster_shared_dir"]
        venv = str(REPO / ".venv") if loopback else settings["training_venv"]
        launcher_s, first_line_s, started_s, by_hand_s, names = [], [], [], [], []
        try:
            for round_number in range(rounds):
                order = ("launcher", "by hand") if round_number % 2 == 0 else ("by hand", "launcher")
                for kind in order:
                    name = f"bench-launch-{os.getpid()}-{round_number}"
                    if kind == "launcher":
                        names.append(name)
                        launch_dir = Path(f"{shared}/runs/{name}/launch")
                        to_step, to_first_line, to_started = time_launcher(inventory, name, launch_dir)
                        launcher_s.append(to_step)
                        first_line_s.append(to_first_line)
                        started_s.append(to_started)
                    else:
                        names.append(f"{name}-by-hand")
                        by_hand_s.append(
                            time_by_hand(loopback, nodes, port, f"{shared}/runs/{name}-by-hand", venv)
                        )
            names.append(f"bench-launch-{os.getpid()}-phases")
            breakdown = phases(inventory, names[-1])
        finally:
            # The test bed's shared dir is a directory of this machine, bind-mounted into the containers.
            for name in names:
                shutil.rmtree(f"{shared}/runs/{name}", ignore_errors=True)
    return {
        "where": where,
        "launcher": launcher_s,
        "first_line": first_line_s,
        "started": started_s,
        "by_hand": by_hand_s,
        "phases": breakdown,
    }


def _seconds(values: list[float], digits: int = 1) -> str:
    return ", ".join(f"{value:.{digits}f}" for value in values)


def report(result: dict) -> None:
    launcher, by_hand = statistics.median(result["launcher"]), statistics.median(result["by_hand"])
    print(f"\n{result['where']}:")
    print(f"  trainer launch      : {launcher:6.1f} s to the first step ({_seconds(result['launcher'])})")
    print(f"  torchrun by hand    : {by_hand:6.1f} s to the first step ({_seconds(result['by_hand'])})")
    print(f"  launcher overhead   : {launcher - by_hand:6.1f} s (ratio {launcher / by_hand:.2f}x)")
    print(
        f"  its first line at   : {statistics.median(result['first_line']):6.2f} s (the command's own "
        "start-up: interpreter, imports, inventory, plan)"
    )
    started = statistics.median(result["started"])
    print(
        f"  its trainers from   : {started:6.2f} s ({_seconds(result['started'], 2)}: the last node's run.sh "
        "started; the launcher's part before its trainers run)"
    )
    # Per round: from the last node's run.sh to rank 0's step on the screen. Against torchrun by hand
    # (which has no launcher before it) this is the launcher's share after its trainers start; the
    # phases below are one launch, too few to weigh a second against the medians.
    after_start = [to_step - at for to_step, at in zip(result["launcher"], result["started"], strict=True)]
    print(
        f"  its trainers' part  : {statistics.median(after_start):6.2f} s ({_seconds(after_start, 2)}: from "
        f"the last node's run.sh to the step on the screen; torchrun by hand: {by_hand:.2f} s)"
    )
    print("  one launch by phase (seconds from the start, in-process):")
    previous = 0.0
    for name, at in sorted(result["phases"], key=lambda mark: mark[1]):
        print(f"    {at:6.2f} (+{at - previous:5.2f})  {name}")
        previous = at


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--loopback", action="store_true", help="loopback hosts only, even if the test bed is up"
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each, interleaved (default: 3)")
    args = parser.parse_args()
    places = [("two loopback hosts on this machine", True, 2)]
    if not args.loopback and testbed_up():
        places.append(("the test bed (ct-head, ct-worker1, ct-worker2)", False, 3))
    print(f"launch overhead: nodes x 1 process, gloo, first logged step of rank 0; {args.rounds} rounds each")
    for where, loopback, hosts in places:
        report(measure(where, loopback, hosts, args.rounds))
    if len(places) == 1:
        print(
            "\n(the test bed is not up: scripts/testbed/molecule.sh converge, then status `up`, "
            "to measure it too)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
