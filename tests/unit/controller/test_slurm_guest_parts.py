"""The parts of a launch inside a Slurm allocation that need no Slurm (issue 40): the inventory's
settings on the allocation's nodes, the step's scripts as bash runs them, and slurm.json as status,
logs and stop read it. The launch itself, on a real Slurm: tests/local/test_slurm_guest.py."""

from __future__ import annotations

import getpass
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.plan_inventory import three_nodes

from trainer.controller.inventory import load_cluster
from trainer.controller.launcher.plan import make_plan
from trainer.controller.launcher.runscript import IB_DISABLE, IFACE
from trainer.controller.launcher.slurm_allocation import SlurmError, SlurmNode, guest_cluster
from trainer.controller.launcher.slurm_runs import slurm_launch
from trainer.controller.launcher.slurm_steps import SlurmRecord, step_run_script, step_script

NODES = [SlurmNode("gpu-a17", "10.9.0.17"), SlurmNode("gpu-a18", "10.9.0.18")]


def allocation_plan(tmp_path, env=None, **group_vars):
    inventory = three_nodes(tmp_path, cluster_training_user=getpass.getuser(), **group_vars)
    cluster = guest_cluster(load_cluster(inventory), NODES, env or {})
    return make_plan(cluster, run_name="guest")


def test_the_allocations_nodes_replace_the_inventorys_hosts(tmp_path):
    plan = allocation_plan(tmp_path, cluster_shared_dir=str(tmp_path / "shared"))
    topo = plan.topology
    assert [(n.host, n.node_rank, n.address) for n in topo.nodes] == [
        ("gpu-a17", 0, "10.9.0.17"),
        ("gpu-a18", 1, "10.9.0.18"),
    ]
    assert topo.master_addr == "10.9.0.17" and topo.gpus_per_node == 2, "the inventory's 2 processes per node"
    assert plan.output_dir == str(tmp_path / "shared" / "runs" / "guest")


def test_the_allocations_gpus_are_the_nodes_accelerators(tmp_path):
    plan = allocation_plan(tmp_path, env={"SLURM_GPUS_ON_NODE": "8"}, training_procs_per_node="")
    assert plan.topology.gpus_per_node == 8 and plan.topology.world_size == 16


def test_another_training_user_is_refused_with_the_fix(tmp_path):
    inventory = three_nodes(tmp_path, cluster_training_user="someone-else")
    with pytest.raises(SlurmError, match=r"runs as the allocation's owner .* or add --over-ssh"):
        guest_cluster(load_cluster(inventory), NODES, {})


def test_the_steps_scripts_are_valid_bash_with_the_probe_values_found_on_the_node(tmp_path):
    plan = allocation_plan(tmp_path, cluster_nccl_ib_disable="auto")
    run_sh = step_run_script(plan, "gpu-a18")
    assert IFACE not in run_sh and IB_DISABLE not in run_sh
    assert "export NCCL_SOCKET_IFNAME==$(clustertrain_iface)" in run_sh
    assert "export NCCL_IB_DISABLE=$(clustertrain_ib_disable)" in run_sh
    (tmp_path / "run.sh").write_text(run_sh)
    assert subprocess.run(["bash", "-n", str(tmp_path / "run.sh")], capture_output=True).returncode == 0
    # The resolver finds an interface toward the head; here the head is this machine's loopback.
    resolver = (
        "clustertrain_iface() {" + run_sh.split("clustertrain_iface() {", 1)[1].split("\n}\n", 1)[0] + "\n}"
    )
    found = subprocess.run(
        ["bash", "-c", resolver + "\nMASTER_ADDR=127.0.0.1 clustertrain_iface"],
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0 and found.stdout.strip() == "lo", found.stdout + found.stderr


def test_the_step_script_picks_the_node_by_slurms_name_and_refuses_any_other(tmp_path):
    plan = allocation_plan(tmp_path)
    script = tmp_path / "slurm-step.sh"
    script.write_text(step_script(plan))
    assert f"gpu-a18) exec /bin/bash {plan.launch_dir}/node-1/run.sh ;;" in script.read_text()
    other = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        env={"SLURMD_NODENAME": "gpu-a99", "PATH": "/bin"},
    )
    assert other.returncode == 2 and "node gpu-a99 is not a node of this launch" in other.stderr


def test_slurm_json_names_the_run_only_while_it_is_the_heads_latest_launch(tmp_path):
    plan = allocation_plan(tmp_path, cluster_shared_dir=str(tmp_path / "shared"))
    record = SlurmRecord(job="41", step="41.0", step_name="clustertrain-guest-1", launch_id="guest-1")
    record.nodes = {"gpu-a17": 0, "gpu-a18": 1}
    head = tmp_path / "shared" / "runs" / "guest" / "launch" / "node-0"
    head.mkdir(parents=True)
    record.write(plan.launch_dir)
    (head / "launch-id").write_text("guest-1\n")
    assert slurm_launch(plan) == record
    # A later launch of the run over SSH: its launch id is another; status reads the nodes over SSH.
    (head / "launch-id").write_text("guest-2\n")
    assert slurm_launch(plan) is None


def test_attach_to_a_slurm_run_says_which_commands_follow_it(tmp_path):
    plan = allocation_plan(tmp_path, cluster_shared_dir=str(tmp_path / "shared"))
    (Path(plan.launch_dir) / "node-0").mkdir(parents=True)
    SlurmRecord(job="41", step="41.0", launch_id="guest-1", nodes={"gpu-a17": 0}).write(plan.launch_dir)
    (Path(plan.launch_dir) / "node-0" / "launch-id").write_text("guest-1\n")
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "attach", "-i", str(tmp_path / "inventory"), "--run-name", "guest"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "latest launch is Slurm step 41.0 of job 41, which attach does not follow yet" in done.stderr
    assert "`trainer logs -f` and `trainer status`" in done.stderr
