"""The files a launch writes into the run's launch dir on the shared dir, for the nodes and for people.

- `config.yaml` (bundled trainer only): the resolved trainer config every node trains with;
- `deepspeed.json`: the run's DeepSpeed config (DEEPSPEED_CONFIG on every node);
- `accelerate-nodeN.yaml`: node N's accelerate config (ACCELERATE_CONFIG_FILE on node N), the per-node
  file the SimpleTuner guide tells users to edit by hand on each machine (`machine_rank` differs);
- `hostfile`: the DeepSpeed launcher's host list;
- `README.txt`: what each file is and the commands that run the same job by hand, as written.

The bundled trainer builds its DeepSpeed config on the nodes with trainer.ds_config.build; `deepspeed.json`
is built here by the same function from the same values, so that a hand run sees what the trainer
used, the user's own JSON (distributed.deepspeed_config) merged in where the controller can read it
(a path on the nodes is read here as it is, a relative one from the head's working directory). One
it cannot read, or one the nodes will refuse (they name the disagreement at start), leaves the
config built from the trainer's keys. For a user's own command the batch sizes are `auto`: Hugging
Face Trainer and accelerate fill them in from the script's own arguments, as in the Qwen guide's
ds_config_zero2.json.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from trainer import ds_config
from trainer.configerror import ConfigError
from trainer.controller.launcher.plan import JobPlan


def on_gpus(plan: JobPlan) -> bool:
    return all(int(n.vars.get("cluster_accelerators") or 0) > 0 for n in plan.topology.nodes)


def mixed_precision(plan: JobPlan) -> str:
    """`bf16` or `no`, as the run's config says; `auto` is bf16 on GPU nodes (what the trainer picks
    on GPUs that support bf16) and no on the CPU."""
    wanted = str(plan.config["train"].get("mixed_precision", "auto"))
    if wanted == "auto":
        return "bf16" if on_gpus(plan) else "no"
    return wanted


def deepspeed_values(plan: JobPlan) -> ds_config.TrainerValues:
    """The bundled trainer's values as the nodes will see them (bf16 as mixed_precision decides)."""
    train, distributed = plan.config["train"], plan.config["distributed"]
    return ds_config.TrainerValues(
        micro_batch_size=plan.micro_batch_size,
        gradient_accumulation_steps=plan.gradient_accumulation_steps,
        world_size=plan.topology.world_size,
        grad_clip=train["grad_clip"],
        zero_stage=int(distributed["zero_stage"]),
        bf16=mixed_precision(plan) == "bf16",
        optimizer=train["optimizer"],
        learning_rate=train["learning_rate"],
        weight_decay=train["weight_decay"],
    )


def user_deepspeed_json(plan: JobPlan) -> tuple[dict[str, Any] | None, str]:
    """The user's own DeepSpeed JSON and its path as given, or None where there is none the
    controller can read."""
    path = str(plan.config["distributed"].get("deepspeed_config") or "")
    if not path:
        return None, path
    local = Path(path).expanduser()
    if not local.is_absolute():
        local = Path(plan.workdir(plan.topology.nodes[0])) / local
    try:
        return ds_config.load_user_config(str(local)), path
    except ConfigError:
        return None, path


def deepspeed_config(plan: JobPlan) -> dict[str, Any]:
    if not plan.runs_bundled_trainer:
        return ds_config.for_own_command(int(plan.config["distributed"].get("zero_stage", 2)))
    values = deepspeed_values(plan)
    user, path = user_deepspeed_json(plan)
    if user is not None:
        try:
            return ds_config.build(values, user, path)
        except ConfigError:
            pass  # the nodes refuse it at start, naming the disagreement
    return ds_config.build(values)


def accelerate_config(plan: JobPlan, node_rank: int) -> dict[str, Any]:
    topo = plan.topology
    return {
        "compute_environment": "LOCAL_MACHINE",
        # On the CPU too: accelerate starts one process per node for MULTI_CPU (or needs mpirun);
        # MULTI_GPU starts GPUS_PER_NODE processes through torch's launcher, and run.sh's
        # ACCELERATE_USE_CPU=true on CPU nodes (plan.JobPlan.node_env) makes every Accelerator()
        # use gloo, with or without cpu=True in the script. use_cpu here would make accelerate
        # start a single process.
        "distributed_type": "MULTI_GPU",
        "machine_rank": node_rank,
        "main_process_ip": topo.master_addr,
        "main_process_port": topo.master_port,
        "main_training_function": "main",
        "mixed_precision": mixed_precision(plan),
        "num_machines": topo.nnodes,
        "num_processes": topo.world_size,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }


def launch_files(plan: JobPlan) -> dict[str, str]:
    """File name (in the launch dir) -> text."""
    topo = plan.topology
    files: dict[str, str] = {}
    if plan.runs_bundled_trainer:
        # With its secrets (the webhook URL): node_ctl.py writes it readable by the training user only.
        files["config.yaml"] = "# The resolved trainer config every node of this run trains with.\n" + (
            yaml.safe_dump(plan.node_config, sort_keys=False)
        )
    files["deepspeed.json"] = json.dumps(deepspeed_config(plan), indent=2) + "\n"
    files["hostfile"] = "".join(f"{n.address} slots={topo.gpus_per_node}\n" for n in topo.nodes)
    for node in topo.nodes:
        files[f"accelerate-node{node.node_rank}.yaml"] = (
            f"# Node {node.node_rank} ({node.host}) of run {plan.run_name}: only machine_rank differs "
            "between the nodes' files.\n"
        ) + yaml.safe_dump(accelerate_config(plan, node.node_rank), sort_keys=False)
    files["README.txt"] = readme(plan)
    return files


def hand_run_commands(plan: JobPlan) -> tuple[str, dict[int, str]]:
    """The bundled trainer's job started by hand with DeepSpeed's launcher (one command, on the head)
    or accelerate's (node rank -> the command for that node), run from the launch dir. README.txt
    shows them; tests run them as written."""
    venv = PurePosixPath(plan.training_venv) / "bin"
    trainer = [str(venv / "trainer"), "train", "--config", "config.yaml"]
    topo = plan.topology
    deepspeed = [
        str(venv / "deepspeed"),
        "--hostfile",
        "hostfile",
        # One host runs locally (pdsh's SSH check would only get in the way); more go through pdsh.
        *(["--no_ssh_check"] if topo.nnodes == 1 else ["--launcher", "pdsh"]),
        f"--master_addr={topo.master_addr}",
        f"--master_port={topo.master_port}",
        # The trainer is a program, not a python file, and reads LOCAL_RANK from its environment.
        "--no_python",
        "--no_local_rank",
        *trainer,
    ]
    accelerate = {
        node.node_rank: shlex.join(
            [
                str(venv / "accelerate"),
                "launch",
                "--config_file",
                f"accelerate-node{node.node_rank}.yaml",
                "--no_python",
                *trainer,
            ]
        )
        for node in topo.nodes
    }
    return shlex.join(deepspeed), accelerate


def readme(plan: JobPlan) -> str:
    topo = plan.topology
    what = (
        f"the bundled trainer, engine {plan.engine}"
        if plan.runs_bundled_trainer
        else f"your command: {shlex.join(plan.user_command)}"
    )
    lines = [
        f"Run {plan.run_name}, started by `trainer launch` ({topo.nnodes} nodes x {topo.gpus_per_node} "
        f"processes; {what}).",
        "",
        "  node-N/run.sh      what node N ran: its environment and command. To run node N by hand,",
        "                     on node N as the training user: bash node-N/run.sh (then node-N/log)",
        "  node-N/log         node N's output for the latest launch; node-N/log.1, log.2, ... and",
        "                     exit.1, exit.2, ... are the earlier launches' (never deleted)",
        "  node-N/secret-env  the secret variables (training_env/--env), readable by the training user",
        "  deepspeed.json     DEEPSPEED_CONFIG on every node",
        "  accelerate-nodeN.yaml  ACCELERATE_CONFIG_FILE on node N (only machine_rank differs)",
        "  hostfile           the DeepSpeed launcher's hosts",
    ]
    if plan.runs_bundled_trainer:
        deepspeed, accelerate = hand_run_commands(plan)
        lines += [
            "  config.yaml        the resolved trainer config (trainer train --config config.yaml)",
            "",
            "The same job with DeepSpeed's launcher, from this directory on the head. With more than",
            "one host it reaches the others with pdsh over SSH as the training user: install pdsh on",
            "the head, or pick another of its launchers (--launcher openmpi needs mpirun), or run",
            "each node-N/run.sh instead:",
            f"  {deepspeed}",
            "",
            "The same job with accelerate: from this directory, on every node at the same time (on",
            "multi-homed hosts export NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME as node-N/run.sh does):",
            *(f"  node {node.node_rank} ({node.host}): {accelerate[node.node_rank]}" for node in topo.nodes),
        ]
    else:
        lines += [
            "",
            "deepspeed.json has `auto` batch sizes and precision: Hugging Face Trainer (--deepspeed",
            "$DEEPSPEED_CONFIG) and accelerate fill them in from your script's own arguments.",
            "accelerate launch --config_file $ACCELERATE_CONFIG_FILE starts the node's processes",
            "(`trainer launch -- accelerate launch ...` adds it); plain torchrun reads PET_NNODES,",
            "PET_NODE_RANK, PET_MASTER_ADDR, ... from node-N/run.sh; `trainer launch -- deepspeed ...`",
            "runs one node's share per node (--no_ssh --node_rank N --hostfile hostfile).",
        ]
    return "\n".join(lines) + "\n"
