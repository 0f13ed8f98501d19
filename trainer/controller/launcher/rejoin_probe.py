"""The probe of the nodes a launch left out (the mechanism under rejoin.py's policy): while the job runs
at the smaller size, every `interval_s` one run of probe.yml asks all of them at once (one
ansible-playbook, one task per node) the start's own probe (node_ctl.probe through the launch_node
action: the venv has what the job needs, the node's interface holds its address, no run of the same
name still runs there). A node that answers and passes is "back"; one that answers with a problem
is not, and the problem is kept to be said; one that does not answer is still gone.

The probe runs on a thread of its own: the attempt's playbook is followed on the main thread, and a
probe that waits on a vanished node's connect timeout must not hold up the polls of the live nodes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.wire import PLAYBOOKS, WatchOptions, launch_env, launch_vars, start_calls
from trainer.controller.runner import PlaybookResult, run_playbook

PROBE_TASK = "Probe the node"


@dataclass(frozen=True)
class ProbeAnswer:
    """One node's answer to one probe round."""

    answered: bool
    """It could be reached and its probe ran."""
    problem: str = ""
    """Why it cannot start now (the start's own message and fix); empty when it can."""

    @property
    def ready(self) -> bool:
        return self.answered and not self.problem


def probe_vars(plan: JobPlan, options: WatchOptions, hosts: list[str]) -> dict[str, Any]:
    """probe.yml's variables for `hosts`, each node's request as the start's probe makes it under `plan`
    (the plan with every node: each node's dir is that of its rank there)."""
    extravars = launch_vars(plan, options, launch_id="", become={}, lock_request={})
    start_calls(extravars)
    return {
        "launch_training_user": plan.training_user,
        "launch_command_timeout_s": options.command_timeout_s,
        # Never the head (it cannot be left out), so no request takes the run's lock or tests the port.
        "launch_rejoin_probes": {host: extravars["launch_nodes"][host]["probe"]["request"] for host in hosts},
    }


def answers_of(result: PlaybookResult, hosts: list[str]) -> dict[str, ProbeAnswer]:
    """Each host's answer in probe.yml's result: passed, failed with its problem, or unreachable."""
    answers: dict[str, ProbeAnswer] = {}
    for host in hosts:
        item = result.task_result(host, PROBE_TASK)
        if item is None or item.status == "unreachable":
            answers[host] = ProbeAnswer(answered=False)
        elif item.status == "failed":
            answers[host] = ProbeAnswer(answered=True, problem=item.message or "the probe failed")
        else:
            answers[host] = ProbeAnswer(answered=True)
    return answers


class RejoinProbe:
    """Probes `hosts` every `interval_s` on a thread of its own until `stop()`; `on_answers` gets each
    round's answers (on that thread)."""

    def __init__(
        self,
        plan: JobPlan,
        options: WatchOptions,
        hosts: list[str],
        on_answers: Callable[[dict[str, ProbeAnswer]], None],
        *,
        interval_s: float,
    ) -> None:
        self.plan = plan
        self.hosts = list(hosts)
        self.on_answers = on_answers
        self.interval_s = interval_s
        self.extravars = probe_vars(plan, options, self.hosts)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rejoin-probe", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ends the rounds; a round under way is canceled (its ansible-playbook terminated)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def probe_once(self) -> dict[str, ProbeAnswer]:
        result = run_playbook(
            PLAYBOOKS / "probe.yml",
            self.plan.topology.inventory,
            self.extravars,
            env=launch_env(),
            limit=",".join(self.hosts),
            cancel=self._stopped,
        )
        return answers_of(result, self.hosts)

    def _loop(self) -> None:
        # The first round after one interval: the node was lost just now.
        while not self._stopped.wait(self.interval_s):
            try:
                answers = self.probe_once()
            except Exception as err:  # a probe that cannot run says so, and the run goes on
                failed = ProbeAnswer(answered=False, problem=f"probe failed: {err!r}")
                answers = dict.fromkeys(self.hosts, failed)
            if not self._stopped.is_set():
                self.on_answers(answers)
