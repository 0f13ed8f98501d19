"""When a run that left a node out grows back (launcher/rejoin.py under restarts.RestartPolicy), with
the attempts and the probe played by the test: node2 is lost and left out, the run goes on at 2 nodes,
then node2's probe answers. By default the attempt is ended at rank 0's next checkpoint line and the
next one runs on all 3 nodes with the user's batch split, without a restart; --no-rejoin probes
nothing; a node whose environment is not current (the start's probe fails on it) is not taken back and
the problem is named; a node whose start fails at its rejoin is left out again and never probed again."""

from __future__ import annotations

import dataclasses
import io

from helpers.loopback import write_inventory
from helpers.played_attempts import PlayedAttempts
from rich.console import Console

from trainer import exitcodes
from trainer.controller.inventory import load_cluster
from trainer.controller.launcher.failure import Diagnosis, Event, Outcome
from trainer.controller.launcher.live import JobMonitor, LiveView
from trainer.controller.launcher.plan import make_plan
from trainer.controller.launcher.rejoin import Rejoin
from trainer.controller.launcher.rejoin_probe import ProbeAnswer
from trainer.controller.launcher.restarts import RestartPolicy
from trainer.controller.launcher.wire import WatchOptions

VENV_PROBLEM = (
    "the trainer's venv /srv/venv on node2 lacks trainer: install the trainer there (make provision)"
)


class Probes:
    """The probe of the nodes left out, as rejoin_probe.RejoinProbe is made: each answers `answer` once
    started; what was probed is kept."""

    def __init__(self, answer: ProbeAnswer) -> None:
        self.answer = answer
        self.probed: list[list[str]] = []

    def __call__(self, plan, options, hosts, on_answers, *, interval_s):
        probes = self

        class Probe:
            def start(self) -> None:
                probes.probed.append(list(hosts))
                on_answers(dict.fromkeys(hosts, probes.answer))

            def stop(self) -> None:
                pass

        return Probe()


class Attempts(PlayedAttempts):
    """The first attempt loses node2; each later one, on 2 nodes, goes through steps 1-40 with a
    checkpoint every 10 and asks `grow` after each line, as the follow handlers do; on 3 nodes it is
    done, or (`fail_rejoin`) its start fails on node2."""

    def __init__(self, plan, *, fail_rejoin: bool = False, first: Outcome | None = None) -> None:
        super().__init__(plan)
        self.fail_rejoin, self.first = fail_rejoin, first
        self.records: list[dict] = []
        self.grows: list[object] = []

    def attempt(self, view, record, *, grow=None, **kwargs):
        hosts = [n.host for n in self.plan.topology.nodes]
        self.records.append(record)
        self.grows.append(grow)
        if len(self.records) == 1 and self.first is not None:
            return self.first
        if len(self.records) == 1:
            return Outcome(exitcodes.NODE_LOST, "failed", ["node2"], "node2 lost", True, lost=["node2"])
        if len(hosts) == 3:
            if self.fail_rejoin and not any(r.get("rejoin_failed") for r in self.records):
                return Outcome(
                    exitcodes.FAILURE, "start_failed", ["node2"], "could not start on node2: port in use"
                )
            return Outcome(exitcodes.OK, "done")
        monitor = JobMonitor(
            {h: i for i, h in enumerate(hosts)}, "node0", LiveView(Console(file=io.StringIO()))
        )
        for step in range(11, 41):
            lines = [f"step {step}/40 | loss 2.0"]
            if step % 10 == 0:
                lines.append(f"checkpoint /shared/runs/r/checkpoints/step-{step}")
            monitor.apply(monitor.hosts["node0"], {"state": "running", "lines": lines})
            if grow is not None and grow.due(monitor):
                return Outcome(
                    exitcodes.OK, "rejoin", latest_checkpoint=f"/shared/runs/r/checkpoints/step-{step}"
                )
        return Outcome(exitcodes.OK, "done")


def run_policy(tmp_path, answer: ProbeAnswer | None, **attempts):
    """The policy over three loopback nodes (micro batch 2, accumulation 1); None: --no-rejoin."""
    cluster = load_cluster(write_inventory(tmp_path, nodes=3)[0])

    def replan(excluded, extra):
        kept = dataclasses.replace(
            cluster, workers=tuple(h for h in cluster.workers if h.name not in excluded)
        )
        return make_plan(kept, run_name="r", overrides=["train.micro_batch_size=2", *extra])

    launcher = Attempts(replan(set(), []), **attempts)
    out = io.StringIO()
    view = LiveView(Console(file=out, force_terminal=False, width=400))
    probes = Probes(answer or ProbeAnswer(answered=True))
    rejoin = (
        Rejoin(launcher.plan, WatchOptions(), view, interval_s=3, probe_factory=probes) if answer else None
    )
    policy = RestartPolicy(launcher, view, max_restarts=1, exclude_failed=True, replan=replan, rejoin=rejoin)
    code = policy.run()
    return code, out.getvalue(), launcher, probes, policy


def test_a_node_back_is_taken_in_at_the_next_checkpoint_without_a_restart(tmp_path):
    code, out, launcher, probes, policy = run_policy(tmp_path, ProbeAnswer(answered=True))
    assert code == exitcodes.OK, out
    assert launcher.plans == [["node0", "node1"], ["node0", "node1", "node2"]], out
    assert probes.probed == [["node2"]], "probed while the run went on at 2 nodes, only then"
    # Seen back before step 11; the checkpoint at step 20 is the first after that.
    assert (
        "node2 is back: growing to 3 nodes from step-20 (micro batch 1 -> 2, accumulation 3 -> 1, effective "
        "batch 6 kept); "
        "no restart used" in out
    ), out
    assert policy.restarts == 1 and policy.rejoins == 1, "the loss used the one restart; growing back none"
    record = launcher.records[-1]
    assert record["event"] == "rejoin" and record["why"] == "rejoin" and record["rejoined"] == ["node2"]
    assert record["resume_from"].endswith("step-20")
    assert (record["micro_batch_size"], record["gradient_accumulation_steps"]) == (2, 1), "the user's split"
    assert record["restart"] == 1 and not record["restart_used"], record


def test_no_rejoin_probes_nothing_and_the_run_ends_at_the_smaller_size(tmp_path):
    code, out, launcher, _, _ = run_policy(tmp_path, None)
    assert code == exitcodes.OK, out
    assert launcher.plans == [["node0", "node1"]], out
    assert launcher.grows == [None, None] and "back" not in out, out


def test_a_node_whose_environment_differs_is_not_taken_back_and_the_problem_is_named(tmp_path):
    code, out, launcher, probes, _ = run_policy(tmp_path, ProbeAnswer(answered=True, problem=VENV_PROBLEM))
    assert code == exitcodes.OK, out
    assert launcher.plans == [["node0", "node1"]], "the run ended at 2 nodes"
    assert probes.probed == [["node2"]]
    assert f"node2 answers but cannot rejoin the run: {VENV_PROBLEM} (probed again every 3 s)" in out, out
    assert out.count("cannot rejoin") == 1, "said once, not at every probe"


def test_a_node_that_cannot_start_at_its_rejoin_is_left_out_again_and_not_probed_again(tmp_path):
    code, out, launcher, probes, policy = run_policy(tmp_path, ProbeAnswer(answered=True), fail_rejoin=True)
    assert code == exitcodes.OK, out
    assert launcher.plans == [["node0", "node1"], ["node0", "node1", "node2"], ["node0", "node1"]], out
    assert (
        "node2 could not start at its rejoin (could not start on node2: port in use): left out again" in out
    )
    assert probes.probed == [["node2"]], "not probed again after its failed rejoin: no loop"
    assert policy.restarts == 1, "neither growing back nor leaving it out again used a restart"
    assert launcher.records[-1]["rejoin_failed"] == ["node2"] and not launcher.records[-1]["restart_used"]


def test_a_node_left_out_at_fault_while_it_answers_is_not_probed_back(tmp_path):
    """node2 left out for what it did while it answered (a rank stuck in the kernel there): it answers
    any probe at once, and taken back it would hang the same way, so it stays out."""
    stuck = Event(0.0, "node2", 2, "hung", exitcodes.HUNG, "in uninterruptible sleep — state D", rank=4)
    stuck = dataclasses.replace(stuck, node_at_fault=True)
    diagnosis = Diagnosis(stuck, head="node0")
    first = Outcome(exitcodes.HUNG, "failed", ["node2"], "node2 hung", True, diagnosis=diagnosis)
    code, out, launcher, probes, policy = run_policy(tmp_path, ProbeAnswer(answered=True), first=first)
    assert code == exitcodes.OK, out
    assert diagnosis.at_fault == ["node2"]
    assert launcher.plans == [["node0", "node1"]], "left out, and the run ended at 2 nodes"
    assert probes.probed == [] and "back" not in out, out
    assert policy.rejoins == 0
