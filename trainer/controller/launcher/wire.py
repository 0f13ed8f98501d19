"""What the launcher's playbooks (start.yml, watch.yml, stop.yml) get and say: their environment,
their extra variables (LAUNCH_VARS, made by launch_vars), each node's probe and start arguments
(start_calls), and the names of the tasks whose events the launcher reads. The playbooks and the
launch_node action plugin are the other side of this module: a name changed here is changed there.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from trainer.controller import forks
from trainer.controller.launcher.command_forms import script_of
from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.runscript import node_dir, run_script
from trainer.controller.launcher.stall import STALL_FLOOR_S
from trainer.controller.launcher.topology import AUTO_IFNAME
from trainer.controller.launcher.world import WORLD_TIMEOUT_S

PLAYBOOKS = PurePosixPath(__file__).parent / "playbooks"
#: start.yml's one node task: the probe, the launcher's word, the start and the watch (Ansible forks a
#: worker per node and task). Its result's `phase` says how far it got: probe, start, watch.
LAUNCH_TASK = "Probe the node, start the trainer once every node passed, and follow it until it ends"
WATCH_TASK = "Follow the trainer until it ends"
STOP_TASK = "Stop the trainer's process group"
STATES_TASK = "Read the ranks' process states"
#: ansible-playbook's settings for every run of a launch. ansible.cfg of the current directory is not
#: read for these playbooks, so what matters here is set outright. Forks (launch_env) bound concurrency
#: only (Ansible starts a worker per host of a task, up to this many): the watch needs a worker per node
#: for the whole run, so they are as many as this machine holds (trainer.controller.forks), a job with
#: more nodes is refused (launch_cli.follow_problem), and the setting is known before the inventory is
#: read (the prestarted start).
LAUNCH_ENV = {
    "ANSIBLE_PIPELINING": "True",
    "ANSIBLE_NOCOLOR": "True",
    "ANSIBLE_GATHERING": "explicit",
    "ANSIBLE_RETRY_FILES_ENABLED": "False",
}
#: start.yml's tasks that a launch has no use for tag themselves so (start.yml's header).
START_SKIP_TAG = "launch_skip"
#: The extra variables of the launcher's playbooks (launch_vars): start.yml is started before the plan
#: is made and given them then (runner.PrestartedRun), so their names are known in advance.
LAUNCH_VARS = frozenset(
    {
        "launch_run_name",
        "launch_id",
        "launch_dir",
        "launch_output_dir",
        "launch_head",
        "launch_hosts",
        "launch_master_port",
        "launch_training_user",
        "launch_nodes",
        "launch_venv_needs",
        "launch_files",
        "launch_info",
        "launch_record",
        "launch_become_hosts",
        "launch_command_timeout_s",
        "launch_poll_s",
        "launch_quiet_s",
        "launch_status_timeout_s",
        "launch_give_up_s",
        "launch_stop_grace_s",
        "launch_has_secrets",
        "launch_stacks",
        "launch_states",
        "launch_peers",
        "launch_stop_record",
        "launch_tail",
        "launch_lock_request",
        "launch_lock_in_probe",
        "launch_bundled_trainer",
        "launch_activity",
        "launch_release_lock",
        "launch_release_lock_when_done",
        "launch_reuse",
    }
)
#: Without --stall-timeout, the ceiling of the adaptive stall bound (the bundled trainer's steps, a
#: user's command's quiet: launcher/stall.py, live.JobMonitor).
STALL_CEILING_S = 600.0
#: The longest a follow's poll waits on a quiet node (WatchOptions.quiet_s): following a node costs the
#: controller a round trip (an ssh client, a worker's wake-up) per poll, 0.2 % of a core at one per
#: 2 s; one per 10 s costs a fifth of it, and a node's end still answers at once.
QUIET_S = 10.0
#: Connections that run a task as `ansible_user` (without become): ssh's and paramiko's.
SSH_CONNECTIONS = frozenset(
    {"ssh", "ansible.builtin.ssh", "paramiko", "paramiko_ssh", "ansible.builtin.paramiko_ssh"}
)
#: The local connection runs every task as the launcher's own account.
LOCAL_CONNECTIONS = frozenset({"local", "ansible.builtin.local"})


def launch_env() -> dict[str, str]:
    """LAUNCH_ENV with the forks: every node this machine can follow at once (the same all run long)."""
    return {**LAUNCH_ENV, "ANSIBLE_FORKS": str(forks.fork_limit())}


@dataclass(frozen=True)
class WatchOptions:
    """How a launch is followed (the command line's --poll-interval, --unreachable-grace, ...)."""

    poll_interval_s: float = 2.0
    unreachable_grace_s: float = 60.0
    stall_timeout_s: float | None = None
    #: The bundled trainer without --stall-timeout: the bound adapts to the job (live.stall_bound_s), and
    #: stall_timeout_s is its ceiling, the bound before the steps' times are known and during an
    #: announced evaluation or checkpoint save.
    stall_adaptive: bool = False
    stop_grace_s: float = 10.0
    world_timeout_s: float = WORLD_TIMEOUT_S

    @classmethod
    def defaults(cls, bundled: bool) -> WatchOptions:
        """What a launch is followed with when the command line gives nothing: the stall bound adapts to
        the job, under STALL_CEILING_S (the bundled trainer's steps; a user's command's quiet, where a
        culprit must be named before the ceiling)."""
        return cls(stall_timeout_s=STALL_CEILING_S, stall_adaptive=True)

    @property
    def status_timeout_s(self) -> float:
        """How long one poll may go unanswered before it counts as missed (beyond its own wait)."""
        return min(30.0, max(5.0, self.unreachable_grace_s / 3))

    @property
    def quiet_s(self) -> float:
        """How long a poll waits on a node with nothing new (a worker's: its lines are not shown live):
        QUIET_S, or less where the grace or the stall timeout is short (progress and misses arrive
        this late at most), never under the poll interval."""
        bounds = [QUIET_S, self.unreachable_grace_s / 6]
        if self.stall_timeout_s:
            bounds.append((STALL_FLOOR_S if self.stall_adaptive else self.stall_timeout_s) / 4)
        return max(self.poll_interval_s, min(bounds))

    @property
    def command_timeout_s(self) -> float:
        """How long a probe, check, start or stop may take on a node (beyond a stop's grace): a node
        that takes longer is named as not answering, and the launch goes on without waiting for it."""
        return min(60.0, max(10.0, self.unreachable_grace_s / 2))


def connecting_user(host_vars: Mapping[str, Any]) -> str | None:
    """The account Ansible runs a host's tasks as (before become), where its inventory variables say
    so outright: this process's own for a local connection, `ansible_user` for ssh given in full;
    None when only the host can tell (the `id -un` round trip) or a become variable is set."""
    if any(key.startswith("ansible_become") for key in host_vars) or "ansible_ssh_user" in host_vars:
        return None
    connection = host_vars.get("ansible_connection")
    if connection in LOCAL_CONNECTIONS:
        try:
            return pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:
            return None
    user = host_vars.get("ansible_user")
    if connection in SSH_CONNECTIONS and isinstance(user, str) and user:
        return user
    return None


def lock_in_probe(plan: JobPlan) -> bool:
    """Whether the head's probe takes the run's lock in its own round trip (start.yml): when the
    inventory says Ansible reaches the head as the training user. Otherwise a round trip finds out
    who it connects as, and another takes the lock, become the training user if need be."""
    user = connecting_user(plan.topology.head.vars)
    return user is not None and plan.training_user in ("", user)


def launch_vars(
    plan: JobPlan,
    options: WatchOptions,
    *,
    launch_id: str,
    become: dict[str, bool],
    lock_request: dict[str, Any],
    **extra: Any,
) -> dict[str, Any]:
    """The extra variables of every playbook of a launch (LAUNCH_VARS): `extra` replaces defaults
    that one playbook sets (the start's files and records, the stop's record and stacks)."""
    topo = plan.topology
    venv_bin = str(PurePosixPath(plan.training_venv) / "bin")
    nodes = {}
    for n in topo.nodes:
        check = (
            {}
            if plan.runs_bundled_trainer
            else {
                "workdir": plan.workdir(n),
                "program": plan.node_command(n)[0],
                "venv_bin": venv_bin,
                "script": script_of(plan.user_command) or "",
            }
        )
        nodes[n.host] = {
            "node_rank": n.node_rank,
            "address": n.address,
            "ifname_auto": n.nccl_socket_ifname == AUTO_IFNAME,
            "node_dir": node_dir(plan, n),
            "check": check,
            "run_sh": run_script(plan, n, n.host),
            "secret_env": plan.node_secret_env(n),
            # The head's files this node's command reads: wait until the shared dir shows them.
            "wait_for": [
                f"{plan.launch_dir}/config.yaml"
                if plan.runs_bundled_trainer
                else plan.accelerate_config_path(n)
            ],
        }
    return {
        "launch_run_name": plan.run_name,
        "launch_id": launch_id,
        "launch_dir": plan.launch_dir,
        "launch_output_dir": plan.output_dir,
        "launch_head": topo.head.host,
        "launch_hosts": [n.host for n in topo.nodes],
        "launch_master_port": topo.master_port,
        "launch_training_user": plan.training_user,
        "launch_nodes": nodes,
        "launch_venv_needs": ["python", "torchrun", "trainer"] if plan.runs_bundled_trainer else ["python"],
        "launch_files": {},
        "launch_info": {},
        "launch_record": {},
        "launch_become_hosts": become,
        "launch_command_timeout_s": options.command_timeout_s,
        "launch_poll_s": options.poll_interval_s,
        "launch_quiet_s": options.quiet_s,
        "launch_status_timeout_s": options.status_timeout_s,
        # A safety net only: the launcher fails the node after the grace and cancels the watch.
        "launch_give_up_s": options.unreachable_grace_s + 300,
        "launch_stop_grace_s": options.stop_grace_s,
        "launch_has_secrets": plan.has_secrets,
        "launch_stacks": False,
        # A stall: each node reports its ranks' process states before it stops them (hang.py).
        "launch_states": False,
        # A stall's states read (states.yml): host -> its peers' [host, address], each tried on the
        # master port (a partial partition: a node its peers' connects get no answer from).
        "launch_peers": {},
        "launch_stop_record": {},
        "launch_tail": 20,
        "launch_lock_request": lock_request,
        "launch_lock_in_probe": lock_in_probe(plan),
        "launch_bundled_trainer": plan.runs_bundled_trainer,
        "launch_activity": not plan.runs_bundled_trainer,  # what its ranks use (live.JobMonitor's quiet)
        "launch_release_lock": False,
        "launch_release_lock_when_done": True,
        "launch_reuse": False,
        **extra,
    }


def drop_node_files(extravars: dict[str, Any]) -> None:
    """Empty each node's run.sh and secret variables in `extravars`, for a playbook that must not
    carry them (every one but a start that writes them). The names stay: the prestarted run expects
    exactly LAUNCH_VARS."""
    for node in extravars["launch_nodes"].values():
        node["secret_env"], node["run_sh"] = {}, ""


def start_calls(extravars: dict[str, Any]) -> None:
    """Give each node of start.yml's extra variables its probe's and its start's arguments (`probe`,
    `start`: request, timeout, the watch's settings), made here rather than by a template per value in
    the tasks: Ansible compiles every template of a task's arguments again in each host's worker
    (the forked ansible-playbook that runs the task), 37 templates for a probe and 53 for a start, most
    of the controller's CPU per node. The head's differ: its master port, the run's lock (where its
    probe takes it), the launch's files and record."""
    head = extravars["launch_head"]
    lock = extravars["launch_lock_request"] if extravars["launch_lock_in_probe"] else {}
    for host, node in extravars["launch_nodes"].items():
        is_head = host == head
        node["probe"] = {
            "timeout_s": extravars["launch_command_timeout_s"],
            "request": {
                "need": extravars["launch_venv_needs"],
                "address": node["address"],
                "iface_auto": node["ifname_auto"],
                "port": extravars["launch_master_port"] if is_head else 0,
                "node_dir": node["node_dir"],
                "run_name": extravars["launch_run_name"],
                "training_user": extravars["launch_training_user"],
                "check": node["check"],
                "lock": lock if is_head else {},
            },
        }
        node["start"] = {
            # The request holds the secret variables and the config's webhook URL: never an argument.
            "secret": extravars["launch_has_secrets"],
            "timeout_s": extravars["launch_command_timeout_s"] + 60,
            "request": {
                "node_dir": node["node_dir"],
                "launch_id": extravars["launch_id"],
                "launch_dir": extravars["launch_dir"],
                "files": extravars["launch_files"] if is_head else {},
                "secret_env": node["secret_env"],
                "run_sh": node["run_sh"],
                "wait_for": node["wait_for"],
                "info": extravars["launch_info"],
                "record": extravars["launch_record"] if is_head else {},
                "reuse": extravars["launch_reuse"],
            },
            "follow": {
                "poll_s": extravars["launch_poll_s"],
                "quiet_s": extravars["launch_quiet_s"],
                "timeout_s": extravars["launch_status_timeout_s"],
                "give_up_s": extravars["launch_give_up_s"],
                # Only rank 0's lines are shown as they come: a worker's poll answers on its trainer's
                # end or after launch_quiet_s, one round trip per node every few seconds.
                "request": {
                    "node_dir": node["node_dir"],
                    "offset": 0,
                    "quiet": not is_head,
                    "activity": extravars["launch_activity"],
                },
            },
        }
    # Moved into the start, not copied: start.yml reads them nowhere else, and the values file the
    # prestarted run reads would carry the secrets and scripts twice.
    drop_node_files(extravars)
    extravars.update(launch_files={}, launch_info={}, launch_record={})
