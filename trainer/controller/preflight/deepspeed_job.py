"""A tiny DeepSpeed job (the bundled trainer, ZeRO-2, a few steps) started exactly the way
`trainer launch` starts training, whose checkpoint must then be found in the shared dir on the head.

This is the seed guide's "run a small DeepSpeed job to confirm checkpoints are written to the
master's directory", done for the user. It goes through the launcher's own command so it tests
the path a real launch takes (rendezvous, env, shared dir), not a parallel one.
"""

from __future__ import annotations

import json
import secrets
import shlex
import subprocess
import sys
from pathlib import Path

from trainer.controller.inventory import Cluster
from trainer.controller.preflight.report import FAIL, PASS, Result

CHECK = "deepspeed"
PLAYBOOK = Path(__file__).parent / "playbooks" / "checkpoint.yml"
VERIFY_TASK = "Preflight | checkpoint on the head"
STEPS = 4


def launch_command(cluster: Cluster, run_name: str) -> list[str]:
    return [
        sys.executable, "-m", "trainer", "launch", "-i", str(cluster.inventory),
        "--engine", "deepspeed", "--run-name", run_name,
        "--set", "distributed.zero_stage=2",
        "--set", f"train.max_steps={STEPS}",
        "--set", "train.warmup_steps=0",
        "--set", "train.log_every=1",
        "--set", f"checkpoint.save_steps={STEPS}",
    ]  # fmt: skip


def run_check(cluster: Cluster, timeout_s: float = 900) -> list[Result]:
    head = cluster.head
    shared = str(head.get("cluster_shared_dir", ""))
    run_name = f"preflight-deepspeed-{secrets.token_hex(4)}"
    run_dir = f"{shared.rstrip('/')}/runs/{run_name}"
    command = launch_command(cluster, run_name)
    try:
        launched = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return [
            Result(
                CHECK,
                head.name,
                FAIL,
                f"the DeepSpeed job did not finish in {timeout_s:.0f} s",
                fix=f"stop it (trainer launch -i {cluster.inventory} --run-name {run_name} --stop) "
                "and run it by hand to see where it hangs (rendezvous: master port, ufw)",
            )
        ]
    if launched.returncode != 0:
        tail = "\n".join((launched.stdout + launched.stderr).strip().splitlines()[-12:])
        causes, fix = _node_errors(cluster, run_dir)
        if causes:
            tail = f"{tail}\nerrors in the nodes' logs ({run_dir}/launch):\n{causes}"
        return [
            Result(
                CHECK,
                head.name,
                FAIL,
                f"the DeepSpeed job (ZeRO-2, {STEPS} steps) failed, exit {launched.returncode}:\n{tail}",
                fix=(fix + "; then " if fix else "")
                + f"run it by hand to see the whole log: {shlex.join(['trainer', *command[3:]])}",
                data={"command": command},
            )
        ]

    from trainer.controller.runner import run_playbook

    verified = run_playbook(PLAYBOOK, cluster.inventory, extravars={"preflight_run_dir": run_dir})
    item = verified.task_result(head.name, VERIFY_TASK)
    if item is None or item.status != "ok" or not item.result.get("stdout"):
        why = item.message if item else (verified.output.strip()[-300:] or "the check did not run")
        return [
            Result(
                CHECK,
                head.name,
                FAIL,
                f"could not look for the checkpoint on the head: {why}",
                fix="check that Ansible reaches the head",
            )
        ]
    found = json.loads(str(item.result["stdout"]).strip().splitlines()[-1])
    if found["error"] or not found["files"]:
        return [
            Result(
                CHECK,
                head.name,
                FAIL,
                f"the job finished but no checkpoint is in {run_dir} on {head.name}: "
                f"{found['error'] or 'the step dir is empty'}",
                fix=f"the nodes write to {shared} but the head does not see it: mount the head's export "
                "at the same path on every node (NFS client role), then retry",
                data=found,
            )
        ]
    return [
        Result(
            CHECK,
            head.name,
            PASS,
            f"ZeRO-2 job on {len(cluster.hosts)} node(s) wrote {found['latest']} ({found['files']} files, "
            f"{found['bytes'] / 1e6:.1f} MB) to {shared}; seen on {head.name}, removed",
            data=found,
        )
    ]


#: Known causes in a node's log -> the fix.
KNOWN_CAUSES = (
    (
        "Error building extension 'deepspeed_shm_comm'",
        "install a C++ compiler (g++) on every node: DeepSpeed builds its CPU comm op at first start",
    ),
    (
        "Address already in use",
        "something holds the master port on the head: stop it or change cluster_master_port",
    ),
)


def _node_errors(cluster: Cluster, run_dir: str) -> tuple[str, str]:
    """The error lines of each node's log of a failed run, read on the head, and a fix if one is known."""
    from trainer.controller.runner import run_playbook

    result = run_playbook(PLAYBOOK, cluster.inventory, extravars={"preflight_run_dir": run_dir})
    item = result.task_result(cluster.head.name, VERIFY_TASK)
    try:
        errors = json.loads(str(item.result["stdout"]).strip().splitlines()[-1])["node_errors"]
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return "", ""
    text = "\n".join(f"{node}: {line[:300]}" for node, lines in errors.items() for line in lines)
    fixes = [fix for needle, fix in KNOWN_CAUSES if needle in text]
    return text, "; ".join(fixes)
