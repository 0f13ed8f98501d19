"""The job a JobPlan describes, as a batch script for a scheduler: Slurm (sbatch) or PBS/Torque (qsub).

The scripts follow the de facto multi-node template (the Qwen guide's): one task per node, the
head's address from the allocation (`scontrol show hostnames` / `$PBS_NODEFILE`) resolved to an IP,
the NCCL settings, the run's output dir on the shared dir. What every node runs is one static
script, `<run>/launch/node.sh`, written by the batch script when the job starts together with the
run's files (deepspeed.json, accelerate-nodeN.yaml, config.yaml for the bundled trainer) and
`job.env` (the job's MASTER_ADDR, NNODES, id). Under Slurm `srun` starts node.sh once per node
(NODE_RANK = SLURM_NODEID); under PBS the batch script starts it over SSH with the rank as its
argument; by hand, `bash node.sh RANK` on each node.

The bundled trainer starts as `torchrun` with a c10d rendezvous on the master port (the scheduler
decides which hosts the job gets, so the rendezvous, not the inventory, orders them); a user's own
command runs as given, in the working directory, with the same environment `trainer launch` gives.
Every value written into a script is quoted with shlex.quote; names were checked by the plan.

No secret is in a script: the scheduler keeps the script in its state and accounting (`scontrol
write batch_script`, sacct) where its admins and tools read it. The secret variables (secret-env,
sourced by node.sh) and a trainer config holding a secret are written by `trainer sbatch` into the
launch dir, mode 0600 (private_files). Before the job writes anything, the batch script takes the
output dir's job lock (trainer.joblock): a second job of the run is refused while the first runs.
"""

from __future__ import annotations

import json
import shlex
from pathlib import PurePosixPath

import yaml

from trainer.controller.launcher.launchfiles import accelerate_config, deepspeed_config, on_gpus
from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.runscript import SAVE_SIGNAL_IGNORED
from trainer.controller.launcher.slurm_batch import BatchOptions
from trainer.controller.launcher.topology import AUTO_IFNAME
from trainer.controller.training_env import IB_AUTO, IB_DEVICES_DIR
from trainer.joblock import HEARTBEAT_S
from trainer.joblock import LOCK_FILE as JOB_LOCK_FILE

#: The site's defaults (BatchOptions is frozen: one shared value).
DEFAULT_OPTIONS = BatchOptions()
#: Variables node.sh sets from the job (job.env) or per node, not from the plan's fixed values.
_RUNTIME = {
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "WORLD_SIZE",
    "ACCELERATE_CONFIG_FILE",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "NCCL_IB_DISABLE",
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
}


#: Shell lines that set $iface to the interface this node reaches $MASTER_ADDR through (on the head,
#: the interface holding it): NCCL_SOCKET_IFNAME auto where no probe ran before the start (a batch
#: job's node.sh, a Slurm step's run.sh: slurm_steps.py).
IFACE_TOWARD_HEAD = (
    "iface=$(ip -o route get \"$MASTER_ADDR\" 2>/dev/null | sed -n 's/.* dev \\([^ ]*\\).*/\\1/p')",
    'if [ -z "$iface" ] || [ "$iface" = lo ]; then',
    '  iface=$(ip -o addr show | awk -v a="$MASTER_ADDR" '
    '\'{split($4, p, "/"); sub(/@.*/, "", $2)} p[1] == a {print $2; exit}\')',
    "fi",
)
#: A shell test, true where this node lists InfiniBand/RoCE devices (NCCL_IB_DISABLE auto).
HAS_IB_DEVICES = f'[ -n "$(ls -A {IB_DEVICES_DIR} 2>/dev/null)" ]'


def _heredoc(path: str, text: str, private: bool = False) -> str:
    """Shell that writes `text` to `path` (a quoted shell word) exactly, nothing expanded."""
    delimiter = "CLUSTERTRAIN_EOF"
    while delimiter in text:
        delimiter += "_"
    body = f"cat > {path} <<'{delimiter}'\n{text if text.endswith(chr(10)) else text + chr(10)}{delimiter}\n"
    # Secrets (the webhook URL in config.yaml, secret variables): readable by the job's user only.
    return f"(umask 077\n{body})\n" if private else body


def _launch_dir(plan: JobPlan) -> str:
    return shlex.quote(plan.launch_dir)


def node_script(plan: JobPlan) -> str:
    """node.sh: what every node runs (NODE_RANK from $1 or SLURM_NODEID)."""
    head = plan.topology.head
    env = {k: v for k, v in plan.node_env(head).items() if k not in _RUNTIME}
    if head.nccl_socket_ifname != AUTO_IFNAME:
        for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            if value := plan.topology.node_env(head).get(key):
                env[key] = value
    lines = [
        "#!/bin/bash",
        f"# Node script of run {plan.run_name}, written by `trainer sbatch`: every node of the job runs it,",
        "# under srun (NODE_RANK = SLURM_NODEID) or as `bash node.sh RANK` (PBS, or by hand on each node).",
        "set -euo pipefail",
        f"launch_dir={_launch_dir(plan)}",
        "# MASTER_ADDR, NNODES and CLUSTER_JOB_ID: written by the batch script when the job started.",
        '. "$launch_dir/job.env"',
        'export NODE_RANK="${1:-${SLURM_NODEID:?run this under srun or give the node rank as its argument}}"',
        *(f"export {name}={shlex.quote(value)}" for name, value in env.items()),
        "export WORLD_SIZE=$((NNODES * GPUS_PER_NODE))",
        "# torchrun reads the options it is not given from PET_*: a plain `torchrun train.py` joins the job.",
        'export PET_NNODES="$NNODES" PET_NODE_RANK="$NODE_RANK" PET_MASTER_ADDR="$MASTER_ADDR"',
        'export ACCELERATE_CONFIG_FILE="$launch_dir/accelerate-node$NODE_RANK.yaml"',
    ]
    if head.nccl_socket_ifname == AUTO_IFNAME:
        lines += [
            "# NCCL_SOCKET_IFNAME auto: the interface this node reaches the head through (on the head,",
            "# the interface holding MASTER_ADDR).",
            *IFACE_TOWARD_HEAD,
            'if [ -n "$iface" ]; then export NCCL_SOCKET_IFNAME="=$iface" GLOO_SOCKET_IFNAME="$iface"; fi',
        ]
    if plan.topology.nccl_ib_disable == IB_AUTO:
        lines += [
            f"# NCCL_IB_DISABLE auto: 0 where {IB_DEVICES_DIR} lists InfiniBand/RoCE devices, else 1.",
            f"if {HAS_IB_DEVICES}; then export NCCL_IB_DISABLE=0; else export NCCL_IB_DISABLE=1; fi",
        ]
    else:
        lines.append(f"export NCCL_IB_DISABLE={int(plan.topology.nccl_ib_disable)}")
    if plan.node_secret_env(head):
        lines.append('. "$launch_dir/secret-env"  # the secret variables, readable by the job\'s user only')
    venv_bin = PurePosixPath(plan.training_venv) / "bin"
    lines += [
        f'export PATH={shlex.quote(str(venv_bin))}:"$PATH"',
        "export PYTHONUNBUFFERED=1",
        'echo "[clustertrain] $(date -Is) node $NODE_RANK of $NNODES on $(hostname),"'
        ' "master $MASTER_ADDR:$MASTER_PORT"',
        f"cd {shlex.quote(plan.workdir(head))}",
    ]
    if plan.runs_bundled_trainer:
        # Static, as `trainer launch` starts it: the node's rank is the scheduler's node id and node 0
        # (MASTER_ADDR) hosts the store. A c10d rendezvous hosted by node 0 failed jobs that had
        # trained to the end: node 0's torchrun exits with its store first, and a slower node's
        # torchrun then fails to close the rendezvous (exit 1, "failed to shutdown the rendezvous").
        lines += [
            "# The address this node reaches the head from (torchrun would otherwise advertise whatever",
            "# the host name resolves to).",
            'local_addr=$(ip -o route get "$MASTER_ADDR" 2>/dev/null'
            " | sed -n 's/.* src \\([^ ]*\\).*/\\1/p')",
            *SAVE_SIGNAL_IGNORED,
            f'exec {shlex.quote(str(venv_bin / "torchrun"))} --nnodes="$NNODES" '
            '--nproc-per-node="$GPUS_PER_NODE" --node-rank="$NODE_RANK" '
            '--master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" '
            '${local_addr:+--local-addr="$local_addr"} --max-restarts=0 \\\n'
            f"  --no-python {shlex.quote(str(venv_bin / 'trainer'))} train"
            ' --config "$launch_dir/config.yaml"',
        ]
    else:
        lines.append(f"exec {shlex.join(plan.user_command)}")
    return "\n".join(lines) + "\n"


def _config_text(plan: JobPlan) -> str:
    return "# The resolved trainer config every node of this run trains with.\n" + yaml.safe_dump(
        plan.node_config, sort_keys=False
    )


def private_files(plan: JobPlan) -> dict[str, str]:
    """The run's files that hold secrets (launch dir name -> text): the secret variables, sourced by
    node.sh, and a trainer config with a secret in it. Never in the batch script: the scheduler keeps
    a job's script in its state (and accounting), readable long after the job. `trainer sbatch`
    writes them into the launch dir on the shared dir, mode 0600, as `trainer launch` writes a
    node's secret-env."""
    files = {}
    secrets = plan.node_secret_env(plan.topology.head)
    if secrets:
        files["secret-env"] = "".join(
            f"export {name}={shlex.quote(value)}\n" for name, value in sorted(secrets.items())
        )
    if plan.runs_bundled_trainer and plan.config_has_secrets:
        files["config.yaml"] = _config_text(plan)
    return files


def _take_job_lock(plan: JobPlan) -> list[str]:
    """Batch-script lines that take the output dir's job lock (trainer.joblock) before the job touches
    the run's files, release it when the script ends, and keep it fresh meanwhile."""
    python = shlex.quote(str(PurePosixPath(plan.training_venv) / "bin" / "python"))
    joblock = f"{python} -I -m trainer.joblock"
    holder = shlex.quote(f"the batch job of run {plan.run_name}")
    return [
        "# One job per output dir (trainer/joblock.py): a second job of this run while this one runs is",
        "# refused here (exit 2, naming this job) before it touches the run's files; the trainer on the",
        "# nodes finds the lock held by its own job (CLUSTER_JOB_ID) and goes on under it.",
        f"output_dir={shlex.quote(plan.output_dir)}",
        f'lock_token=$({joblock} take "$output_dir" --pid $$ --job "$CLUSTER_JOB_ID" --command {holder})'
        " || exit $?",
        f'trap \'kill "$heartbeat" 2>/dev/null; {joblock} release "$output_dir" --token "$lock_token"\' EXIT',
        "# The heartbeat, for a job on another host (which cannot look up this shell's pid): while this",
        "# shell lives. It stops with the shell, so the lock of a killed job goes stale.",
        f'while kill -0 $$ 2>/dev/null; do touch -c "$output_dir/{JOB_LOCK_FILE}"; sleep {HEARTBEAT_S};'
        " done &",
        "heartbeat=$!",
    ]


def _write_run_files(plan: JobPlan) -> list[str]:
    """Batch-script lines that write the run's files into the launch dir when the job starts."""
    launch = _launch_dir(plan)
    template = dict(
        accelerate_config(plan, 0), machine_rank="__MACHINE_RANK__", main_process_ip="__MASTER_ADDR__"
    )
    lines = [
        f"mkdir -p {launch}",
        _heredoc(f"{launch}/node.sh", node_script(plan)),
        _heredoc(f"{launch}/deepspeed.json", json.dumps(deepspeed_config(plan), indent=2)),
    ]
    if plan.runs_bundled_trainer and not plan.config_has_secrets:
        lines.append(_heredoc(f"{launch}/config.yaml", _config_text(plan), private=True))
    for name in private_files(plan):
        missing = (
            f"the run's {name} (its secrets, written by trainer sbatch into {plan.launch_dir}, never into "
            "this script) is missing: run trainer sbatch again"
        )
        lines.append(f"[ -r {launch}/{name} ] || {{ echo {shlex.quote(missing)} >&2; exit 2; }}")
    lines += [
        "# One accelerate config per node: only machine_rank differs.",
        "accelerate_template=$(cat <<'CLUSTERTRAIN_EOF'\n"
        f"{yaml.safe_dump(template, sort_keys=False)}CLUSTERTRAIN_EOF\n)",
        "for rank in $(seq 0 $((NNODES - 1))); do",
        '  printf \'%s\\n\' "$accelerate_template" | sed -e "s/__MACHINE_RANK__/$rank/" '
        f'-e "s/__MASTER_ADDR__/$MASTER_ADDR/" > {launch}/accelerate-node"$rank".yaml',
        "done",
        "printf 'export MASTER_ADDR=%q\\nexport NNODES=%q\\nexport CLUSTER_JOB_ID=%q\\n' "
        f'"$MASTER_ADDR" "$NNODES" "$CLUSTER_JOB_ID" > {launch}/job.env',
    ]
    return lines


def _header(plan: JobPlan, scheduler: str, submit: str) -> list[str]:
    topo = plan.topology
    what = (
        "the bundled trainer"
        if plan.runs_bundled_trainer
        else f"your command: {shlex.join(plan.user_command)}"
    )
    return [
        "#!/bin/bash",
        f"# Run {plan.run_name} on {scheduler}: {topo.nnodes} nodes x {topo.gpus_per_node} processes,",
        f"# {what}. Written by `trainer sbatch` from {topo.inventory}.",
        f"# Submit it with `{submit}`. Output: {plan.output_dir};",
        "# resubmitting resumes from the run's latest checkpoint (the bundled trainer).",
    ]


def _resolve_head(lookup: str) -> list[str]:
    """Lines that set MASTER_ADDR to the IP of the host `lookup` prints (NCCL and gloo need an address
    every node reaches, not a name some nodes resolve differently)."""
    return [
        f"head_host=$({lookup})",
        "MASTER_ADDR=$(getent ahostsv4 \"$head_host\" | awk 'NR == 1 {print $1}')",
        'if [ -z "$MASTER_ADDR" ]; then',
        '  echo "cannot resolve the head node $head_host to an IPv4 address" >&2',
        "  exit 1",
        "fi",
        "export MASTER_ADDR",
    ]


def slurm_script(plan: JobPlan, options: BatchOptions = DEFAULT_OPTIONS) -> str:
    topo = plan.topology
    lines = [
        *_header(plan, "Slurm", "sbatch FILE"),
        f"#SBATCH --job-name={shlex.quote('clustertrain-' + plan.run_name)}",
        f"#SBATCH --nodes={topo.nnodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if on_gpus(plan):
        lines.append(f"#SBATCH --gpus-per-node={topo.gpus_per_node}")
    if options.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={options.cpus_per_task}")
    if options.time_limit:
        lines.append(f"#SBATCH --time={shlex.quote(options.time_limit)}")
    if options.partition:
        lines.append(f"#SBATCH --partition={shlex.quote(options.partition)}")
    lines += _warning_lines(plan, options)
    lines += [
        "set -euo pipefail",
        "",
        "# The head: the allocation's first node; Slurm's address for it (NodeAddr, often its name).",
        *_resolve_head(
            'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1); '
            "scontrol show node \"$first\" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p'"
            ' | grep . || echo "$first"'
        ),
        "NNODES=$SLURM_JOB_NUM_NODES",
        "CLUSTER_JOB_ID=$SLURM_JOB_ID",
        "",
        *_take_job_lock(plan),
        "",
        *_write_run_files(plan),
        "",
        'echo "[clustertrain] run '
        + plan.run_name
        + ": $NNODES nodes, master $MASTER_ADDR:"
        + str(topo.master_port)
        + '"',
        "# One task per node; the first task to fail ends the others (--kill-on-bad-exit).",
        'srun --kill-on-bad-exit=1 --nodes="$NNODES" --ntasks-per-node=1 --label'
        f" bash {_launch_dir(plan)}/node.sh",
    ]
    return "\n".join(lines) + "\n"


def _warning_lines(plan: JobPlan, options: BatchOptions) -> list[str]:
    """The bundled trainer's save before the job's end: Slurm's SIGUSR2 (trainer.node.save_request) and
    a job that may be requeued, its output appended to across runs."""
    if not plan.runs_bundled_trainer or not options.warning_s:
        return []
    return [
        f"# {options.warning_s} s before the time limit (or on `scancel --signal=USR2 JOB` before a",
        "# preemption) Slurm sends SIGUSR2 to the trainer's processes: it saves the step it is in and",
        "# stops (exit 5). Submit this script again to resume from that checkpoint; `trainer launch` run",
        "# inside the job requeues it itself. A preemption that sends TERM (GraceTime) saves nothing past",
        "# the last periodic checkpoint.",
        f"#SBATCH --signal=USR2@{int(options.warning_s)}",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
    ]


def pbs_script(plan: JobPlan, options: BatchOptions = DEFAULT_OPTIONS) -> str:
    topo = plan.topology
    resources = f"nodes={topo.nnodes}:ppn={options.cpus_per_task or topo.gpus_per_node}"
    if on_gpus(plan):
        resources += f":gpus={topo.gpus_per_node}"
    lines = [
        *_header(plan, "PBS/Torque", "qsub FILE"),
        f"#PBS -N {shlex.quote('clustertrain-' + plan.run_name)}",
        f"#PBS -l {resources}",
    ]
    if options.time_limit:
        lines.append(f"#PBS -l walltime={shlex.quote(options.time_limit)}")
    if options.partition:
        lines.append(f"#PBS -q {shlex.quote(options.partition)}")
    remote_node_sh = shlex.quote(shlex.quote(plan.launch_dir + "/node.sh"))
    lines += [
        "set -euo pipefail",
        "",
        "# The allocation's hosts, each once, in PBS's order; the first is the head.",
        "mapfile -t hosts < <(awk '!seen[$0]++' \"$PBS_NODEFILE\")",
        *_resolve_head('echo "${hosts[0]}"'),
        "NNODES=${#hosts[@]}",
        "CLUSTER_JOB_ID=${PBS_JOBID:-$$}",
        "",
        *_take_job_lock(plan),
        "",
        *_write_run_files(plan),
        "",
        "# One node.sh per host over SSH (BatchMode: keys, never a password prompt), rank as argument.",
        "pids=()",
        'for rank in "${!hosts[@]}"; do',
        # Quoted twice: once for this shell, once for the remote shell ssh hands the line to.
        f'  ssh -o BatchMode=yes "${{hosts[$rank]}}" bash {remote_node_sh} "$rank" &',
        "  pids+=($!)",
        "done",
        "status=0",
        'for pid in "${pids[@]}"; do wait "$pid" || status=$?; done',
        'exit "$status"',
    ]
    return "\n".join(lines) + "\n"
