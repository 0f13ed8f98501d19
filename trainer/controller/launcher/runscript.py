"""`node-N/run.sh`: what one node runs for a launch, written by the launcher's start step.

The node's helper (playbooks/files/node_ctl.py) starts it with setsid (its own process group,
so a stop reaches every process), and `trainer launch` watches `log` and `exit` next to it. It is
also the file to run by hand: as the training user on its node, all nodes at about the same time.

Two values are known only once every node has been probed: the interface holding this node's
cluster address (NCCL_SOCKET_IFNAME auto) and the job's NCCL_IB_DISABLE (auto: 0 only when every
node lists InfiniBand/RoCE devices). They stand here as @CLUSTERTRAIN_IFACE@ and
@CLUSTERTRAIN_IB_DISABLE@ and are filled in by the action plugin right before the start.
"""

from __future__ import annotations

import shlex
from pathlib import PurePosixPath

from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.topology import AUTO_IFNAME, Node
from trainer.controller.training_env import IB_AUTO

IFACE = "@CLUSTERTRAIN_IFACE@"
IB_DISABLE = "@CLUSTERTRAIN_IB_DISABLE@"
#: Where the bundled trainer's ranks write their progress (trainer.node.progress reads this name).
PROGRESS_VARIABLE = "CLUSTERTRAIN_PROGRESS_DIR"
#: Shell lines before the bundled trainer starts: SIGUSR2 asks its ranks for a checkpoint and a stop
#: (trainer.node.save_request), and Slurm's --signal=USR2@SECONDS sends it to every process of the step,
#: this shell and torchrun too, which its default action would kill. Ignored here, it stays ignored
#: across fork and exec (torchrun, its workers' interpreters) until each rank installs its handler.
SAVE_SIGNAL_IGNORED = (
    "# SIGUSR2 is the trainer's save-and-stop request (Slurm sends it to every process before the job's",
    "# end): ignored by this shell and torchrun; each rank takes it with a handler of its own.",
    "trap '' USR2",
)


def flight_recorder_lines(plan: JobPlan) -> list[str]:
    """torch's flight recorder for every command (issue 39), where training_env does not set it."""
    dumps = shlex.quote(str(plan.paths.flight_recorder))
    return [
        "# torch's flight recorder: each rank keeps its last collectives. The bundled trainer's ranks report",
        "# the last they entered, so a stall names the rank that never entered its peers' collective. A NCCL",
        "# collective that times out writes every rank's to one dir of the launch (torchfrtrace reads it).",
        "# training_env may set these; TORCH_FR_BUFFER_SIZE=0 switches the recorder off.",
        'export TORCH_FR_BUFFER_SIZE="${TORCH_FR_BUFFER_SIZE:-2000}"',
        'export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"',
        f'flight_dir={dumps}/"$CLUSTERTRAIN_LAUNCH_ID"',
        'mkdir -p "$flight_dir"',
        'export TORCH_FR_DUMP_TEMP_FILE="${TORCH_FR_DUMP_TEMP_FILE:-$flight_dir/rank_}"',
    ]


def node_dir(plan: JobPlan, node: Node) -> str:
    return str(plan.paths.node_dir(node.node_rank))


def run_script(plan: JobPlan, node: Node, host: str) -> str:
    env = plan.node_env(node)
    lines = [
        "#!/bin/bash",
        f'# Node {node.node_rank} ({host}) of run "{plan.run_name}", written by `trainer launch`.',
        "# `trainer launch` starts this with setsid (its own process group, so a stop reaches every",
        "# process), watches `log` and `exit`, and stops the group with node_ctl.py. To run this node by",
        "# hand instead, run this file as the training user on this node (all nodes at about the same time).",
        "set -u",
        f"cd {shlex.quote(node_dir(plan, node))}",
        "echo $$ > pid.tmp && mv pid.tmp pid",
        "",
    ]
    lines += [f"export {name}={shlex.quote(str(value))}" for name, value in env.items()]
    if node.nccl_socket_ifname == AUTO_IFNAME:
        lines += [
            f'# NCCL_SOCKET_IFNAME was "auto": the interface holding {node.address} on this host.',
            f"export NCCL_SOCKET_IFNAME=={IFACE}",
            f"export GLOO_SOCKET_IFNAME={IFACE}",
        ]
    if plan.topology.nccl_ib_disable == IB_AUTO:
        lines += [
            '# NCCL_IB_DISABLE was "auto": 0 when every node lists InfiniBand/RoCE devices in',
            "# /sys/class/infiniband, else 1.",
            f"export NCCL_IB_DISABLE={IB_DISABLE}",
        ]
    if plan.runs_bundled_trainer:
        lines += [
            "# torchrun's rendezvous id (PET_RDZV_ID): it names this launch's subdir of its --log-dir, where",
            "# each rank's error.json lands (the launcher names the root cause from them).",
            'export PET_RDZV_ID="$(cat launch-id)"',
        ]
    if plan.runs_bundled_trainer:
        lines += SAVE_SIGNAL_IGNORED
    command_line = shlex.join(plan.node_command(node))
    workdir = shlex.quote(plan.workdir(node))
    lines += [
        "# The secret variables of training_env and --env, in a file only the training user can read.",
        "if [ -f secret-env ]; then . ./secret-env; fi",
        f'export PATH={shlex.quote(str(PurePosixPath(plan.training_venv) / "bin"))}:"$PATH"',
        "export PYTHONUNBUFFERED=1",
        "# Marks every process of this launch (torchrun gives each worker a session of its own).",
        'export CLUSTERTRAIN_LAUNCH_ID="$(cat launch-id)"',
        "# The bundled trainer's ranks report the step they are in here (the launcher's stall watchdog).",
        f'export {PROGRESS_VARIABLE}="$PWD/progress"',
        *flight_recorder_lines(plan),
        "",
        "printf '[clustertrain] %s launch %s on %s in %s: %s\\n' \\",
        '  "$(date -Is)" "$CLUSTERTRAIN_LAUNCH_ID" \\',
        f'  "$(hostname)" {workdir} {shlex.quote(command_line)} >> log',
        f"( cd {workdir} && exec {command_line} ) >> log 2>&1 < /dev/null &",
        "child=$!",
    ]
    if plan.world_checked and node.node_rank > 0:
        python = str(PurePosixPath(plan.training_venv) / "bin" / "python")
        lines += [
            "# The world check: the command's processes watched for a connection to the head a few times a",
            "# second until it is seen (a short job joins and ends between two of the launcher's polls).",
            f'env -u CLUSTERTRAIN_LAUNCH_ID {shlex.quote(python)} -I -S node_ctl.py "$PWD" watch-join \\',
            "  < /dev/null > /dev/null 2>&1 &",
        ]
    lines += [
        "# A stop (TERM to the group) reaches the command directly; this shell only records how it ended.",
        "trap 'true' TERM INT HUP",
        "while :; do",
        '  wait "$child"',
        "  rc=$?",
        '  kill -0 "$child" 2>/dev/null || break',
        "done",
        'printf \'{"exit_code": %d, "time": %s}\\n\' "$rc" "$(date +%s.%N)" > exit.tmp && mv exit.tmp exit',
    ]
    return "\n".join(lines) + "\n"
