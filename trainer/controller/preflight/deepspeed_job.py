"""A tiny DeepSpeed job (the bundled trainer, ZeRO-2, a few steps) started exactly the way
`trainer launch` starts training, whose checkpoint must then be found in the shared dir on the head.

This is the seed guide's "run a small DeepSpeed job to confirm checkpoints are written to the
master's directory", done for the user. It runs the launcher itself (trainer.controller.launcher:
the same plan, start, watch and stop playbooks), so it tests the path a real launch takes.

It must never hang silently. Every node's log is followed (the launcher's watch) and the job is
placed in a phase: start (the launcher starts run.sh everywhere), rendezvous (torchrun and the
process group meet on the master port), compile (DeepSpeed builds or loads its ops: one "built
successfully" line per process), setup (deepspeed.initialize), step N, checkpoint. Each phase has
its own bound (BOUNDS_S; a real compile gets minutes, a prebuilt one seconds, a step 20 times the
slowest so far); past it the job is stalled: preflight says which phase and which node(s), stops
the job on every node (the launcher's stop), removes build locks the stopped job left, and only
then returns.

No timeout kills the launcher: it runs in this process, and a bound past, a TERM or a Ctrl-C to
preflight all end in the launcher's own stop, which sends TERM to each node's process group and
KILL only to what is left after the stop grace, so torchrun and DeepSpeed clean up on every node
(tests/local/test_preflight_local.py: a job stuck in its compile, and preflight stopped with TERM, leave
no process of the job). Like any launch, the job holds its run's lock (a fresh run name) until it
has stopped.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.controller.inventory import Cluster, PlanningError
from trainer.controller.launcher.launch import INTERRUPTED, Launcher, WatchOptions
from trainer.controller.launcher.live import STEP_LINE, HostState, JobMonitor, LiveView
from trainer.controller.launcher.live import Stall as LauncherStall
from trainer.controller.launcher.plan import JobPlan, make_plan
from trainer.controller.launcher.restarts import RestartPolicy
from trainer.controller.preflight.report import FAIL, PASS, Result

CHECK = "deepspeed"
PLAYBOOK = Path(__file__).parent / "playbooks" / "checkpoint.yml"
VERIFY_TASK = "Preflight | checkpoint on the head"
STEPS = 4

#: Seconds each phase may last before the job counts as stalled.
BOUNDS_S: dict[str, float] = {
    "start": 300,  # the launcher's start playbook until run.sh logs on every node
    "rendezvous": 300,  # imports, torchrun's rendezvous and the process group on the master port
    "compile": 900,  # DeepSpeed JIT-builds its ops: 4.5 min measured at load 8
    "compile (prebuilt)": 180,  # ops built at provisioning: only torch's up-to-date check and the load
    "setup": 300,  # deepspeed.initialize: engine, ZeRO partitions, the first broadcast
    "step 1": 300,  # the first step also warms everything up
    "step": 120,  # later steps: this, or 20 times the slowest step so far if that is longer
    "checkpoint": 300,  # the checkpoint written to the shared dir and renamed
    "finishing": 120,  # the last lines, the process group torn down
}
STEP_FACTOR = 20
#: Lines every process prints (DeepSpeed's op load), and rank 0's lines that mark a phase's end.
BUILT = re.compile(r"DeepSpeed .* built successfully")
GROUP_FORMED = re.compile(r"^(GPU health monitor|training |resumed from )")
TRAINING = re.compile(r"^training ")
CHECKPOINT = re.compile(r"^checkpoint ")
DONE = re.compile(r"^done: ")
LAUNCHED = re.compile(r"^\[clustertrain\] .* launch ")


def job_overrides() -> list[str]:
    return [
        "distributed.zero_stage=2",
        f"train.max_steps={STEPS}",
        "train.warmup_steps=0",
        "train.log_every=1",
        f"checkpoint.save_steps={STEPS}",
    ]


def job_plan(cluster: Cluster, run_name: str) -> JobPlan:
    """The launch `trainer launch --engine deepspeed --set ...` would make (raises PlanError & co.)."""
    return make_plan(cluster, overrides=job_overrides(), engine="deepspeed", run_name=run_name)


@dataclass
class NodeProgress:
    host: str
    node_rank: int
    launched: bool = False
    built: int = 0
    last_line: str = ""
    last_output_at: float | None = None


@dataclass
class PhaseStall:
    phase: str
    seconds: float
    bound: float
    hosts: list[str]
    detail: str


@dataclass
class Phases:
    """The job's phase from every node's log lines; `stall(now)` when a phase outlasts its bound.

    Time comes in as arguments (`now`), so the rules are tested without waiting."""

    hosts: dict[str, int]
    head: str
    prebuilt: bool
    started_at: float
    bounds: dict[str, float] = field(default_factory=lambda: dict(BOUNDS_S))
    nodes: dict[str, NodeProgress] = field(init=False)
    phase: str = "start"
    entered_at: float = field(init=False)
    group_formed: bool = False
    training: bool = False
    step: int = 0
    total_steps: int = STEPS
    step_seen_at: float | None = None
    slowest_step_s: float = 0.0
    checkpoint_done: bool = False
    done: bool = False

    def __post_init__(self) -> None:
        self.nodes = {h: NodeProgress(h, r) for h, r in self.hosts.items()}
        self.entered_at = self.started_at

    def add_lines(self, host: str, lines: list[str], now: float) -> None:
        node = self.nodes.get(host)
        if node is None:
            return
        for line in lines:
            text = line.strip()
            if not text:
                continue
            node.last_line, node.last_output_at = text[-200:], now
            if LAUNCHED.search(text):
                node.launched = True
            elif BUILT.search(text):
                node.built += 1
                self.group_formed = True  # DeepSpeed's init comes after the process group
            if host != self.head:
                continue
            if GROUP_FORMED.search(text):
                self.group_formed = True
            if TRAINING.search(text):
                self.training = True
            if match := STEP_LINE.match(text):
                step, total = int(match.group(1)), int(match.group(2))
                if self.step_seen_at is not None and step > self.step:
                    self.slowest_step_s = max(self.slowest_step_s, now - self.step_seen_at)
                self.step, self.total_steps, self.step_seen_at = step, total, now
                self.training = True
            if CHECKPOINT.search(text) and self.step >= self.total_steps:
                self.checkpoint_done = True
            if DONE.search(text):
                self.done = True

    def current(self) -> str:
        if not all(n.launched for n in self.nodes.values()):
            return "start"
        if not self.group_formed:
            return "rendezvous"
        if not self.training and any(n.built == 0 for n in self.nodes.values()):
            return "compile (prebuilt)" if self.prebuilt else "compile"
        if not self.step:
            return "setup" if not self.training else "step 1"
        if self.step < self.total_steps:
            return f"step {self.step + 1}"
        if not self.checkpoint_done:
            return "checkpoint"
        return "finishing"

    def update(self, now: float) -> str | None:
        """The new phase's name when it changed, else None."""
        phase = self.current()
        if phase == self.phase:
            return None
        self.phase, self.entered_at = phase, now
        return phase

    def bound(self) -> float:
        if self.phase.startswith("step ") and self.phase != "step 1":
            return max(self.bounds["step"], STEP_FACTOR * self.slowest_step_s)
        return self.bounds.get(self.phase, self.bounds.get(self.phase.split(" ")[0], 300))

    def stall(self, now: float) -> PhaseStall | None:
        if self.done:
            return None
        self.update(now)
        waited = now - self.entered_at
        bound = self.bound()
        if waited <= bound:
            return None
        behind = self._behind()
        quiet = "; ".join(
            f"{n.host}: "
            + (
                f"last output {now - n.last_output_at:.0f} s ago: {n.last_line}"
                if n.last_output_at is not None
                else "no output"
            )
            for n in sorted(self.nodes.values(), key=lambda n: n.node_rank)
        )
        return PhaseStall(self.phase, waited, bound, behind, quiet)

    def _behind(self) -> list[str]:
        """The node(s) the phase waits for, when the logs tell; else every node (a collective)."""
        ordered = sorted(self.nodes.values(), key=lambda n: n.node_rank)
        if self.phase == "start":
            return [n.host for n in ordered if not n.launched]
        if self.phase.startswith("compile"):
            return [n.host for n in ordered if n.built == 0]
        return [n.host for n in ordered]


def stall_fix(stall: PhaseStall, plan: JobPlan) -> str:
    topo = plan.topology
    hosts = ", ".join(stall.hosts) or "every node"
    logs = f"each node's log: {plan.paths.node_log('N')}"
    user = plan.training_user or "the training user"
    if stall.phase == "start":
        return (
            f"run.sh did not start on {hosts}: run `trainer launch -i {topo.inventory} --run-name "
            f"{plan.run_name}` to see the start playbook's error ({logs})"
        )
    if stall.phase == "rendezvous":
        return (
            f"the nodes did not meet on {topo.master_addr}:{topo.master_port}: see the master_port, ufw "
            f"and interface checks; on {topo.head.host}: ss -ltnp 'sport = :{topo.master_port}' ({logs})"
        )
    if stall.phase.startswith("compile"):
        return (
            f"DeepSpeed was still building or loading its op on {hosts}: build the ops ahead "
            "(ansible-playbook site.yml --tags trainer_env), and look for a stale build lock there as "
            f"{user}: {plan.training_venv}/bin/python -m trainer.torch_extensions check"
        )
    if stall.phase == "checkpoint":
        return (
            f"writing the checkpoint to {plan.shared_dir} stalled: see the nfs, shared_dir and space "
            f"checks; on each of {hosts}: stat -f {plan.shared_dir} must return at once"
        )
    return (
        f"a collective stalled (every rank waits for the others) on {hosts}: see the interface and "
        "bandwidth checks; set cluster_nccl_debug: INFO for NCCL to name the failing connection "
        f"({logs})"
    )


class _PhaseMonitor(JobMonitor):
    """The launcher's monitor, also fed to Phases: a phase past its bound is the launcher's stall,
    so the launcher stops every node (with each rank's stack) as for its own stall watchdog."""

    def __init__(self, phases: Phases, say, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.phases = phases
        self.say = say
        self.phase_stall: PhaseStall | None = None

    def apply(self, hs: HostState, report: dict[str, Any]) -> None:
        super().apply(hs, report)
        self.phases.add_lines(hs.host, list(report.get("lines") or []), time.monotonic())

    def check_time(self) -> None:
        super().check_time()
        now = time.monotonic()
        if changed := self.phases.update(now):
            self.say(f"  deepspeed: {changed} ({now - self.phases.started_at:.0f} s after start)")
        if self.stall is not None or self.failed or self.phase_stall is not None:
            return
        stall = self.phases.stall(now)
        if stall is None:
            return
        self.phase_stall = stall
        self.say(
            f"  deepspeed: stalled in {stall.phase} for {stall.seconds:.0f} s (bound {stall.bound:.0f} s) "
            f"on {', '.join(stall.hosts)}: stopping the job on every node"
        )
        self.stall = LauncherStall(
            stall.seconds,
            [(host, None, None) for host in stall.hosts],
            self.phases.step or None,
            f"stalled in phase {stall.phase} for {stall.seconds:.0f} s (its bound: {stall.bound:.0f} s) on "
            f"{', '.join(stall.hosts)}",
        )
        self._note_failure()


class _PhaseLauncher(Launcher):
    """`trainer launch`'s Launcher, following the job's phases (its monitor is a _PhaseMonitor)."""

    def __init__(self, plan: JobPlan, phases: Phases, say) -> None:
        # The launcher's own step watchdog stays on as a backstop, past every phase bound.
        super().__init__(plan, WatchOptions(stall_timeout_s=max(BOUNDS_S.values()) * 2))
        self.phases = phases
        self.say = say
        self.last_monitor: _PhaseMonitor | None = None

    def monitor(self, view: LiveView) -> JobMonitor:
        topo = self.plan.topology
        self.last_monitor = _PhaseMonitor(
            self.phases,
            self.say,
            {n.host: n.node_rank for n in topo.nodes},
            topo.head.host,
            view,
            unreachable_grace_s=self.options.unreachable_grace_s,
            stall_timeout_s=self.options.stall_timeout_s,
            progress_from_steps=True,
            ranks={n.host: n.global_ranks(topo.gpus_per_node) for n in topo.nodes},
        )
        return self.last_monitor


class _QuietView(LiveView):
    """The launcher's messages, indented; node log lines kept for the report, not printed."""

    def __init__(self, say) -> None:
        super().__init__()
        self.say = say
        self.lines: list[str] = []

    def __enter__(self) -> _QuietView:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def log(self, line: str) -> None:
        self.lines.append(line)

    def message(self, text: str) -> None:
        plain = re.sub(r"\[/?[a-z ]+\]", "", text)
        self.lines.append(plain)
        self.say(f"  launch: {plain}")

    def states(self, hosts: list[HostState]) -> None:
        return None


def run_check(
    cluster: Cluster,
    prebuilt: bool = False,
    bounds: dict[str, float] | None = None,
    say=print,
    cleanup=None,
) -> list[Result]:
    """Run the job; `cleanup(newer_than_epoch)` removes build locks a stopped job left (probe.cleanup).
    KeyboardInterrupt: the job is stopped everywhere, locks cleaned, and the interrupt re-raised."""
    head = cluster.head
    run_name = f"preflight-deepspeed-{secrets.token_hex(4)}"
    try:
        plan = job_plan(cluster, run_name)
    except PlanningError as err:
        return [
            Result(
                CHECK,
                head.name,
                FAIL,
                f"the DeepSpeed job cannot be planned: {err}",
                fix=f"see the topology check; `trainer plan -i {cluster.inventory} --engine deepspeed` "
                "shows it",
            )
        ]
    shared, run_dir = plan.shared_dir, plan.output_dir
    started_epoch = time.time()
    phases = Phases(
        {n.host: n.node_rank for n in plan.topology.nodes},
        plan.topology.head.host,
        prebuilt,
        time.monotonic(),
        {**BOUNDS_S, **(bounds or {})},
    )
    view = _QuietView(say)
    launcher = _PhaseLauncher(plan, phases, say)
    code = None
    try:
        code = RestartPolicy(launcher, view).run()
    finally:
        if code != 0 and cleanup is not None:
            # A job stopped while DeepSpeed held its build lock leaves it behind: remove those.
            say(f"  deepspeed: clean-up: {cleanup(started_epoch)}")
    if code == INTERRUPTED:
        raise KeyboardInterrupt("preflight's DeepSpeed job was interrupted (stopped on every node)")
    monitor = launcher.last_monitor
    stall = monitor.phase_stall if monitor is not None else None
    if stall is not None:
        return [
            Result(
                CHECK,
                ", ".join(stall.hosts) or head.name,
                FAIL,
                f"the DeepSpeed job stalled in phase {stall.phase} for {stall.seconds:.0f} s (bound "
                f"{stall.bound:.0f} s) on {', '.join(stall.hosts)}; it was stopped on every node. "
                f"Last output: {stall.detail}",
                fix=stall_fix(stall, plan),
                data={"phase": stall.phase, "hosts": stall.hosts, "run_dir": run_dir},
            )
        ]
    if code != 0:
        tail = "\n".join(view.lines[-14:])
        causes, fix = _node_errors(cluster, run_dir)
        if causes:
            tail = f"{tail}\nerrors in the nodes' logs ({run_dir}/launch):\n{causes}"
        return [
            Result(
                CHECK,
                head.name,
                FAIL,
                f"the DeepSpeed job (ZeRO-2, {STEPS} steps) failed in phase {phases.phase}:\n{tail}",
                fix=(fix + "; then " if fix else "")
                + f"rerun it alone to see every node's log: trainer launch -i {cluster.inventory} "
                f"--engine deepspeed --run-name {run_name} "
                + " ".join(f"--set {o}" for o in job_overrides()),
                data={"run_dir": run_dir, "phase": phases.phase},
            )
        ]

    from trainer.controller.runner import run_playbook

    verified = run_playbook(
        PLAYBOOK, cluster.inventory, extravars={"preflight_run_dir": run_dir}, timeout_s=300
    )
    item = verified.task_result(head.name, VERIFY_TASK)
    if item is None or item.status != "ok" or not item.result.get("stdout"):
        why = item.message if item else (verified.output.strip()[-300:] or "the check did not run")
        return [
            Result(
                CHECK,
                head.name,
                FAIL,
                f"could not look for the checkpoint on {head.name}: {why}",
                fix=f"check that Ansible reaches {head.name} (ansible {head.name} -m ping)",
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
                fix=f"the nodes write to {shared} but {head.name} does not see it: mount {head.name}'s "
                f"export at {shared} on every worker (mount {shared}; "
                "ansible-playbook site.yml --tags nfs_client)",
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
        "install a C++ compiler (g++) on every node and build DeepSpeed's ops ahead: "
        "ansible-playbook site.yml --tags trainer_env",
    ),
    (
        "Address already in use",
        "something holds the master port on the head: stop it (ss -ltnp on the head) or change "
        "cluster_master_port",
    ),
)


def _node_errors(cluster: Cluster, run_dir: str) -> tuple[str, str]:
    """The error lines of each node's log of a failed run, read on the head, and a fix if one is known."""
    from trainer.controller.runner import run_playbook

    result = run_playbook(
        PLAYBOOK, cluster.inventory, extravars={"preflight_run_dir": run_dir}, timeout_s=300
    )
    item = result.task_result(cluster.head.name, VERIFY_TASK)
    try:
        errors = json.loads(str(item.result["stdout"]).strip().splitlines()[-1])["node_errors"]
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        return "", ""
    text = "\n".join(f"{node}: {line[:300]}" for node, lines in errors.items() for line in lines)
    fixes = [fix for needle, fix in KNOWN_CAUSES if needle in text]
    return text, "; ".join(fixes)
