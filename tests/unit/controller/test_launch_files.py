"""The files a launch writes into <run>/launch/: right for the run (precision, batch sizes, ranks), and
the hand-run commands README.txt prints actually train, run as written from that directory."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers.loopback import VENV, free_port
from helpers.plan_inventory import three_nodes, write_inventory

from trainer.controller.launcher.launchfiles import hand_run_commands, launch_files
from trainer.controller.launcher.plan import make_plan

TINY = ("train.max_steps=4", "train.log_every=1", "train.warmup_steps=1", "checkpoint.save_steps=100")


def files_of(plan) -> dict:
    files = launch_files(plan)
    return {
        "deepspeed": json.loads(files["deepspeed.json"]),
        "accelerate": {
            n.node_rank: yaml.safe_load(files[f"accelerate-node{n.node_rank}.yaml"])
            for n in plan.topology.nodes
        },
        "readme": files["README.txt"],
        "names": set(files),
    }


def test_gpu_nodes_with_mixed_precision_auto_get_bf16_everywhere(tmp_path):
    plan = make_plan(three_nodes(tmp_path, head_vars={"cluster_accelerators": 2}, cluster_accelerators=2))
    files = files_of(plan)
    assert files["deepspeed"]["bf16"] == {"enabled": True}
    assert {c["mixed_precision"] for c in files["accelerate"].values()} == {"bf16"}
    assert [c["machine_rank"] for c in files["accelerate"].values()] == [0, 1, 2]
    assert files["deepspeed"]["train_batch_size"] == plan.effective_batch_size


def test_mixed_precision_no_and_the_cpu_turn_bf16_off(tmp_path):
    gpus = three_nodes(tmp_path / "gpus", cluster_accelerators=2)
    for plan in (make_plan(gpus, overrides=["train.mixed_precision='no'"]), make_plan(three_nodes(tmp_path))):
        files = files_of(plan)
        assert files["deepspeed"]["bf16"] == {"enabled": False}
        assert {c["mixed_precision"] for c in files["accelerate"].values()} == {"no"}


def test_an_own_command_gets_auto_batch_sizes_and_no_trainer_config(tmp_path):
    plan = make_plan(three_nodes(tmp_path), command=["bash", "finetune/finetune_lora_ds.sh"])
    files = files_of(plan)
    assert files["deepspeed"]["train_micro_batch_size_per_gpu"] == "auto"
    assert files["deepspeed"]["bf16"] == {"enabled": "auto"}
    assert files["deepspeed"]["zero_optimization"] == {"stage": 2}
    assert "config.yaml" not in files["names"]
    assert "bash finetune/finetune_lora_ds.sh" in files["readme"]


def write_launch_dir(plan) -> Path:
    launch_dir = Path(plan.launch_dir)
    launch_dir.mkdir(parents=True)
    for name, text in launch_files(plan).items():
        (launch_dir / name).write_text(text)
    return launch_dir


def loopback_inventory(tmp_path: Path, hosts: int, procs: int) -> Path:
    # One address per host, as the inventory rules require: all of 127.0.0.0/8 is on lo.
    local = {"ansible_connection": "local", "cluster_accelerators": 0}
    return write_inventory(
        tmp_path,
        {"node0": dict(local, cluster_ip="127.0.0.1")},
        {f"node{i}": dict(local, cluster_ip=f"127.0.0.{i + 1}") for i in range(1, hosts)},
        cluster_master_port=free_port(),
        cluster_shared_dir=str(tmp_path / "shared"),
        training_venv=str(VENV),
        training_procs_per_node=procs,
        cluster_nccl_timeout_s=120,
    )


def readme_command(readme: str, prefix: str) -> list[str]:
    """The command on the README line that starts with `prefix` (after its indentation)."""
    for line in readme.splitlines():
        text = line.strip()
        if text.startswith(prefix):
            return shlex.split(text.removeprefix(prefix) if not prefix.startswith("/") else text)
    raise AssertionError(f"no README line starts with {prefix!r}:\n{readme}")


@pytest.mark.slow
def test_the_readme_deepspeed_command_trains_as_written(tmp_path):
    plan = make_plan(loopback_inventory(tmp_path, hosts=1, procs=2), overrides=list(TINY), run_name="ds")
    launch_dir = write_launch_dir(plan)
    deepspeed, _ = hand_run_commands(plan)
    readme = (launch_dir / "README.txt").read_text()
    assert f"  {deepspeed}\n" in readme
    done = subprocess.run(
        readme_command(readme, str(VENV / "bin" / "deepspeed")),
        cwd=launch_dir, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((Path(plan.output_dir) / "summary.json").read_text())
    assert summary["final_step"] == 4 and summary["world_size"] == 2


@pytest.mark.slow
def test_the_readme_accelerate_commands_train_across_two_nodes_as_written(tmp_path):
    plan = make_plan(loopback_inventory(tmp_path, hosts=2, procs=1), overrides=list(TINY), run_name="acc")
    launch_dir = write_launch_dir(plan)
    readme = (launch_dir / "README.txt").read_text()
    nodes = [
        subprocess.Popen(
            readme_command(readme, f"node {rank} (node{rank}): "),
            cwd=launch_dir,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=600)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)
    summary = json.loads((Path(plan.output_dir) / "summary.json").read_text())
    assert summary["final_step"] == 4 and summary["world_size"] == 2
