"""Launch overhead: `trainer launch` on 2 hosts vs the seed guide's way (torchrun by hand on each host).

Both start the same 2-node job (1 process per node, gloo, the embedded default) and are timed from
the command to the first logged step of rank 0. The launcher's time includes everything it adds:
ansible-runner, the node checks, writing the run's files, starting detached, and the poll that
brings the step line to the screen.

Hosts: the Molecule test bed (ct-head, ct-worker1) when /tmp/clustertrain-testbed.status says
`up`, else two loopback "hosts" on this machine (`--loopback` forces that). Prints the seconds, the
overhead and the ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TESTBED_INVENTORY = REPO / "molecule" / "default" / "inventory"
STATUS = Path("/tmp/clustertrain-testbed.status")
STEP = re.compile(r"^step (\d+)/(\d+)")
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
            "cluster_ip": "127.0.0.1",
            "cluster_accelerators": 0,
        }
        names = [f"node{i}" for i in range(hosts)]
        tree = {
            "cluster": {
                "children": {
                    "head": {"hosts": {names[0]: dict(local)}},
                    "workers": {"hosts": {n: dict(local) for n in names[1:]}},
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
        nodes = [{"name": n, "address": "127.0.0.1"} for n in names]
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


def time_launcher(inventory: Path, run_name: str) -> float:
    sets = [arg for item in TRAIN_SETS for arg in ("--set", item)]
    command = [sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--run-name", run_name, *sets]
    started = time.monotonic()
    first = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            if first is None and STEP.match(line):
                first = time.monotonic() - started
        proc.wait()
    if proc.returncode != 0 or first is None:
        raise SystemExit(f"trainer launch failed (exit {proc.returncode}) or logged no step")
    return first


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
        if first is None and STEP.match(line):
            first = time.monotonic() - started
    codes = [p.wait() for p in procs]
    if any(codes) or first is None:
        raise SystemExit(f"torchrun by hand failed (exit codes {codes}) or logged no step")
    return first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--loopback", action="store_true", help="two loopback hosts even if the test bed is up"
    )
    args = parser.parse_args()
    loopback = args.loopback or not testbed_up()
    where = "two loopback hosts on this machine" if loopback else "the test bed (ct-head, ct-worker1)"
    print(f"launch overhead on {where}: 2 nodes x 1 process, gloo, first logged step of rank 0")
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        workdir = Path(tmp)
        port = free_port() if loopback else 29531
        inventory, nodes = make_inventory(workdir, loopback, hosts=2, port=port)
        settings = {}
        for path in sorted((inventory / "group_vars" / "cluster").glob("*.yml")):
            settings.update(yaml.safe_load(path.read_text()) or {})
        shared = str(workdir / "shared") if loopback else settings["cluster_shared_dir"]
        venv = str(REPO / ".venv") if loopback else settings["training_venv"]
        run_name = f"bench-launch-{os.getpid()}"
        try:
            launcher_s = time_launcher(inventory, run_name)
            by_hand_s = time_by_hand(loopback, nodes, port, f"{shared}/runs/{run_name}-by-hand", venv)
        finally:
            # The test bed's shared dir is a directory of this machine, bind-mounted into the containers.
            for leftover in (f"{shared}/runs/{run_name}", f"{shared}/runs/{run_name}-by-hand"):
                shutil.rmtree(leftover, ignore_errors=True)
    print(f"trainer launch      : {launcher_s:6.1f} s to the first step")
    print(f"torchrun by hand    : {by_hand_s:6.1f} s to the first step")
    print(f"launcher overhead   : {launcher_s - by_hand_s:6.1f} s (ratio {launcher_s / by_hand_s:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
