"""When a run that left nodes out grows back (issue 39), beside the restart policy (restarts.py) that
asks it: with --exclude-failed, the nodes left out are probed while the job goes on at the smaller size
(rejoin_probe.py: one probe.yml run for all of them every --rejoin-probe-interval seconds, the start's
own probe). A node that answers and passes is back; the attempt is then ended right after rank 0's next
"checkpoint ..." line (the save complete, `latest` naming it), so the next attempt resumes from that
checkpoint on all the nodes, at the user's own batch split. The attempt watches `due` (its follow
handlers call it on the main thread); the probe answers on a thread of its own.

Growing back uses no restart. A node whose start fails at its rejoin is left out again and not probed
again in this launch (restarts.py), so a node that answers its probe but cannot start never loops.
A node that answers with a problem (its venv lacks the trainer, an old run of the name still runs
there) is not taken back, and the problem is said once, as the start would say it. `--no-rejoin`:
nothing is probed, the run ends at the smaller size as before. Your own command is not grown back:
the launcher cannot tell when it has saved a checkpoint.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from trainer.controller.launcher.live import JobMonitor, LiveView, node_text
from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.rejoin_probe import ProbeAnswer, RejoinProbe
from trainer.controller.launcher.wire import WatchOptions

#: Seconds between two probes of the nodes left out (--rejoin-probe-interval): one ansible-playbook run
#: for all of them, about a second of the controller's CPU.
REJOIN_PROBE_S = 30.0

#: Makes the probe of some hosts (rejoin_probe.RejoinProbe; a test gives its own).
ProbeFactory = Callable[..., RejoinProbe]


class Rejoin:
    """The nodes left out that are back, and when the running attempt should end to take them in."""

    def __init__(
        self,
        full_plan: JobPlan,
        options: WatchOptions,
        view: LiveView,
        *,
        interval_s: float = REJOIN_PROBE_S,
        probe_factory: ProbeFactory = RejoinProbe,
    ) -> None:
        #: The job with every node (the plan before any was left out): each node's probe request is its.
        self.full_plan = full_plan
        self.options = options
        self.view = view
        self.interval_s = interval_s
        self.probe_factory = probe_factory
        #: Host -> when its probe first passed (time.monotonic()), for the nodes back and not taken in yet.
        self.back: dict[str, float] = {}
        #: Hosts whose start failed at their rejoin: never probed again in this launch.
        self.given_up: set[str] = set()
        self._probe: RejoinProbe | None = None
        self._lock = threading.Lock()
        #: What the probe found to say, said on the main thread (due) in the order it came.
        self._to_say: list[str] = []
        #: Host -> the last problem said of it (a problem is said once, until it changes).
        self._said: dict[str, str] = {}
        #: The checkpoints rank 0 had announced when a node was first seen back in this attempt.
        self._baseline: int | None = None

    # --- the probe (started and stopped by the restart policy around each attempt) -------------------

    def watch(self, excluded: set[str]) -> Rejoin | None:
        """Probe the nodes of `excluded` (but those given up) during the next attempt: self, to hand to
        the attempt; None when there is nothing to probe."""
        hosts = [n.host for n in self.full_plan.topology.nodes if n.host in excluded - self.given_up]
        self.back = {h: t for h, t in self.back.items() if h in hosts}
        self._baseline = None
        if not hosts:
            return None
        self._probe = self.probe_factory(
            self.full_plan, self.options, hosts, self.on_answers, interval_s=self.interval_s
        )
        self._probe.start()
        return self

    def stop_probe(self) -> None:
        if self._probe is not None:
            probe, self._probe = self._probe, None
            probe.stop()

    def on_answers(self, answers: dict[str, ProbeAnswer]) -> None:
        """One probe round's answers (on the probe's thread)."""
        now = time.monotonic()
        with self._lock:
            for host, answer in answers.items():
                if answer.ready:
                    if host not in self.back:
                        self.back[host] = now
                        self._to_say.append(
                            f"{host} answers its probe again: the run grows back to it after its next "
                            "checkpoint"
                        )
                    self._said.pop(host, None)
                    continue
                self.back.pop(host, None)
                if answer.problem and self._said.get(host) != answer.problem:
                    self._said[host] = answer.problem
                    self._to_say.append(
                        f"{host} answers but cannot rejoin the run: {node_text(answer.problem)} (probed "
                        f"again every {self.interval_s:g} s)"
                    )

    # --- the attempt's question --------------------------------------------------------------------

    def due(self, monitor: JobMonitor) -> bool:
        """Whether the attempt should end now to grow back: a node is back and rank 0 has announced a
        complete checkpoint since (not the last step's: the run ends there anyway)."""
        with self._lock:
            said, self._to_say = self._to_say, []
            anyone_back = bool(self.back)
        for line in said:
            self.view.message(line)
        if not anyone_back:
            self._baseline = None
            return False
        if self._baseline is None:
            self._baseline = monitor.checkpoints_seen
            return False
        if monitor.checkpoints_seen <= self._baseline:
            return False
        saved, last_step = monitor.last_checkpoint_step, monitor.step_rate.max_steps
        return not (saved is not None and last_step and saved >= last_step)

    def hosts_back(self) -> list[str]:
        """The nodes back, in rank order."""
        with self._lock:
            back = set(self.back)
        return [n.host for n in self.full_plan.topology.nodes if n.host in back]

    def taken_in(self, hosts: list[str]) -> None:
        with self._lock:
            for host in hosts:
                self.back.pop(host, None)
