"""The restart policy of a launch (--max-restarts, --exclude-failed, --allow-batch-change), above the
Launcher, which runs one attempt (probe, start, follow, stop) and says how it ended (failure.Outcome,
with failure.Diagnosis: the cause and its consequences).

After a failed attempt, in this order:
1. bad input is never restarted: the bundled trainer's exit 2 (config), 3 (data sizing) and 74 (disk
   full) would fail the same way again;
2. the head lost (rank 0, the master, the NFS server of the shared dir) cannot be survived: said
   plainly, with what to run once it is back;
3. a lost node (it stopped answering while its peers failed, or past the unreachable grace, or its
   probe failed at a restart) is left out at once with --exclude-failed; so is a node at fault that
   still answers (a rank hung in uninterruptible sleep: a mount or device of its own, hang.py), and a
   node that was the cause twice. The job starts again on the survivors from the latest complete
   checkpoint, with the effective batch kept: gradient accumulation raised (and the micro batch
   lowered where needed, never above the user's) so that micro × world × accumulation stays the same;
   where the survivors cannot divide it, --allow-batch-change accepts the nearest batch, else the run
   stops saying so;
4. a probe failure at a restart is a node loss to leave out, not a failure that uses up a restart;
5. otherwise a restart is used, up to K.
With --exclude-failed the nodes left out as lost are probed while the job goes on without them
(rejoin.py); one that is back is taken in at the next checkpoint: the attempt stops there and the
next starts on all the nodes at the user's own batch split, which uses no restart (`--no-rejoin`:
never). A node
whose start fails at its rejoin is left out again, without a restart, and not probed again. A node
left out for what it did while it still answered (failing twice, a rank stuck in the kernel there) is
not probed: it would answer at once, and taken back it would fail the same way.
A run that stopped at a checkpoint on request (outcome `saved`: the trainer's exit
STOPPED_AT_CHECKPOINT, a scheduler's warning before the job's end) is not a failure and uses no
restart: the attempts end there, and once the lock is released `after_saved` goes on with it (a Slurm
job is requeued: slurm_requeue.py), or the line says to run the same command again.
Every restart is a line on the screen and a record in `<run>/launch/history.jsonl`, naming the cause,
what changed and the checkpoint it resumes from. A node left out is used again at the next
`trainer launch` of the run (the plan is made from the inventory each time).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from trainer import exitcodes
from trainer.controller.inventory import PlanningError
from trainer.controller.launcher.failure import Outcome
from trainer.controller.launcher.launch_record import RestartState
from trainer.controller.launcher.live import node_text
from trainer.controller.launcher.plan import JobPlan
from trainer.controller.launcher.rejoin import Rejoin

if TYPE_CHECKING:
    from trainer.controller.launcher.live import LiveView

#: make_plan again without some hosts and with more --set (launch_cli.replanner).
Replan = Callable[[set[str], list[str]], JobPlan]


@dataclass(frozen=True)
class BatchSplit:
    """How a world of `world` processes trains the same effective batch."""

    micro_batch_size: int
    accumulation: int
    world: int

    @property
    def effective(self) -> int:
        return self.micro_batch_size * self.accumulation * self.world

    def overrides(self) -> list[str]:
        """The trainer settings (--set) that train this split."""
        return [
            f"train.micro_batch_size={self.micro_batch_size}",
            f"train.gradient_accumulation_steps={self.accumulation}",
        ]

    def change_from(self, plan: JobPlan) -> str:
        """What this split changes in `plan`'s batch, as a restart's line says it: `micro batch 2 -> 1,
        accumulation 1 -> 3, effective batch 6 kept` (the micro batch only where it changes)."""
        effective, micro = plan.effective_batch_size, plan.micro_batch_size
        parts = [f"accumulation {plan.gradient_accumulation_steps} -> {self.accumulation}"]
        if self.micro_batch_size != micro:
            parts.insert(0, f"micro batch {micro} -> {self.micro_batch_size}")
        if self.effective == effective:
            parts.append(f"effective batch {effective} kept")
        else:
            parts.append(f"effective batch {effective} -> {self.effective} (--allow-batch-change)")
        return ", ".join(parts)


def checkpoint_name(path: str) -> str:
    """`step-37` of `/shared/runs/r/checkpoints/step-37` ("" for "")."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def saved_line(outcome: Outcome) -> str:
    """`checkpointed at step 37 on request (exit code 5)`: what a `saved` outcome wrote."""
    step = checkpoint_name(outcome.latest_checkpoint).removeprefix("step-")
    where = f"step {step}" if step.isdigit() else "its latest checkpoint"
    return f"checkpointed at {where} on request (exit code {outcome.code})"


def keep_batch(effective: int, micro_batch_size: int, world: int) -> BatchSplit | None:
    """The split of `effective` over `world` processes with the fewest accumulation steps whose micro
    batch is at most `micro_batch_size` (more would need more memory than the user's run had);
    None when `world` does not divide it."""
    for accumulation in range(1, effective + 1):
        per_step = world * accumulation
        if effective % per_step == 0 and effective // per_step <= micro_batch_size:
            return BatchSplit(effective // per_step, accumulation, world)
    return None


def nearest_batch(effective: int, micro_batch_size: int, world: int) -> BatchSplit:
    """--allow-batch-change: the user's micro batch, the accumulation that comes closest to `effective`."""
    accumulation = max(1, round(effective / (micro_batch_size * world)))
    return BatchSplit(micro_batch_size, accumulation, world)


def split_for_world(plan: JobPlan, world: int, allow_change: bool) -> BatchSplit | None:
    """The split `plan`'s run goes on with on `world` processes: its effective batch kept (keep_batch),
    else with --allow-batch-change the nearest; None where it cannot be kept and no change is allowed."""
    effective, micro = plan.effective_batch_size, plan.micro_batch_size
    split = keep_batch(effective, micro, world)
    if split is None and allow_change:
        split = nearest_batch(effective, micro, world)
    return split


class Attempts(Protocol):
    """What the policy needs of launch.Launcher: one attempt at a time, a new plan, the run's lock."""

    plan: JobPlan

    def attempt(
        self,
        view: LiveView,
        record: dict[str, Any],
        *,
        policy: RestartState | None = None,
        final: bool = True,
        leave_lost: bool = False,
        grow: Rejoin | None = None,
    ) -> Outcome: ...

    def use_plan(self, plan: JobPlan) -> None: ...

    def new_launch(self) -> None: ...

    def take_over_lock(self, view: LiveView) -> int | None: ...

    def release_lock(self, view: LiveView) -> None: ...

    def stop_after_error(self, view: LiveView, error: Exception) -> None: ...


class RestartPolicy:
    def __init__(
        self,
        launcher: Attempts,
        view: LiveView,
        *,
        max_restarts: int = 0,
        exclude_failed: bool = False,
        allow_batch_change: bool = False,
        replan: Replan | None = None,
        restarts_used: int = 0,
        inventory: str = "INVENTORY",
        rejoin: Rejoin | None = None,
        after_saved: Callable[[Outcome], None] | None = None,
    ) -> None:
        self.launcher = launcher
        self.view = view
        self.max_restarts = max_restarts
        self.exclude_failed = exclude_failed and replan is not None
        self.allow_batch_change = allow_batch_change
        self.replan = replan
        self.restarts = restarts_used
        self.inventory = inventory
        self.excluded: set[str] = set()
        #: The nodes left out because they were lost (no answer): the only ones probed to come back.
        self.left_out_lost: set[str] = set()
        self.caused: Counter[str] = Counter()
        #: The latest complete checkpoint the head reported (kept across attempts whose stop could not
        #: ask it, such as a probe that failed).
        self.latest_checkpoint = ""
        #: Takes nodes left out back in (rejoin.py); None with --no-rejoin, without --exclude-failed, and
        #: for your own command (no checkpoint the launcher can see).
        self.rejoin = rejoin if self.exclude_failed and launcher.plan.runs_bundled_trainer else None
        #: The plan before any node was left out: the user's nodes and batch split, grown back to.
        self.full_plan = launcher.plan
        #: Times the run grew back (counted apart from the restarts), and the hosts the last one took in.
        self.rejoins = 0
        self.rejoining: list[str] = []
        #: How the run goes on once it stopped at a checkpoint on request (outcome `saved`), called after
        #: the lock is released: slurm_requeue.py requeues a Slurm job; None says how to resume.
        self.after_saved = after_saved
        #: The attempt that stopped at a checkpoint on request, if the last one did.
        self.saved: Outcome | None = None

    def state(self) -> RestartState:
        """What launch.json records of the policy (`trainer attach` goes on with it)."""
        return RestartState(
            max_restarts=self.max_restarts,
            exclude_failed=self.exclude_failed,
            allow_batch_change=self.allow_batch_change,
            restarts=self.restarts,
        )

    @property
    def plan(self) -> JobPlan:
        return self.launcher.plan

    # --- the whole launch --------------------------------------------------------------------------

    def run(self, *, force: bool = False) -> int:
        """Attempts until one succeeds, is interrupted, or no restart is left; the exit code. The run's
        lock is taken by the first attempt (or here, with `force`) and released on every way out."""
        launcher, view = self.launcher, self.view
        try:
            if force and (code := launcher.take_over_lock(view)) is not None:
                return code
            code = self.go_on()
        except KeyboardInterrupt:
            # Between two attempts (each stops its nodes itself): nothing of this run is running.
            view.message(f"interrupted between two attempts: nothing of run {self.plan.run_name} runs")
            return exitcodes.INTERRUPTED
        except Exception as err:
            # The launcher itself failed (what it could not read, a bug): the run is stopped on every
            # node before its lock is released, never left running unlocked.
            launcher.stop_after_error(view, err)
            raise
        finally:
            launcher.release_lock(view)
        if self.saved is not None:  # the lock released first: a requeued job's launch takes it at once
            (self.after_saved or self._say_how_to_resume)(self.saved)
        return code

    def go_on(self, first: Outcome | None = None) -> int:
        """The attempts; with `first`, the outcome of one already made (`trainer attach`'s)."""
        record: dict[str, Any] = {"event": "launch", "nodes": self._nodes()}
        while True:
            outcome, first = first, None
            if outcome is None:
                outcome = self._attempt(record)
            self.latest_checkpoint = outcome.latest_checkpoint or self.latest_checkpoint
            if outcome.kind == "rejoin":
                record = self._grow_back()
                continue
            if outcome.kind == "saved":  # asked for (a scheduler's warning): not a failure to restart
                self.saved = outcome
                return outcome.code
            if outcome.code in (exitcodes.OK, exitcodes.INTERRUPTED) or outcome.kind == "locked":
                return outcome.code
            step = self._next_step(outcome)
            if step is None:
                return outcome.code
            record = step

    def _attempt(self, record: dict[str, Any]) -> Outcome:
        """One attempt; the nodes left out probed meanwhile where they may come back."""
        final = self.restarts >= self.max_restarts
        out_lost = self.excluded & self.left_out_lost
        grow = self.rejoin.watch(out_lost) if self.rejoin is not None else None
        try:
            return self.launcher.attempt(
                self.view,
                record,
                policy=self.state(),
                final=final,
                leave_lost=self.exclude_failed and not final,
                grow=grow,
            )
        finally:
            if self.rejoin is not None:
                self.rejoin.stop_probe()

    def _next_step(self, outcome: Outcome) -> dict[str, Any] | None:
        """Decide on a failed attempt: the next attempt's history record, or None to stop here."""
        if (again := self._rejoin_failed(outcome)) is not None:
            return again or None
        view, plan = self.view, self.plan
        head = plan.topology.head.host
        diagnosis = outcome.diagnosis
        if head in outcome.lost:
            view.message(
                f"[red]not restarted[/red]: the head {head} (rank 0, the master and the server of the shared "
                f"dir) was lost; the run cannot go on without it. Once {head} is back, run "
                f"`trainer launch -i {self.inventory} --run-name {plan.run_name}` with this launch's "
                f"options: it resumes from the latest complete checkpoint{self._checkpoint_text()}."
            )
            return None
        if not outcome.restartable:
            if self.max_restarts:
                view.message(
                    f"not restarted: {node_text(outcome.reason)} (a restart would fail the same way)"
                )
            return None
        if diagnosis is not None:
            self.caused[diagnosis.cause.host] += 1
        lost = [h for h in outcome.lost if h != head]
        repeat = [h for h, n in self.caused.items() if n >= 2 and h != head and h in self._hosts()]
        # A node at fault that still answers (a rank in state D) is left out as a lost one; without
        # --exclude-failed it is restarted as any failure is (it may have recovered).
        repeat += [h for h in (diagnosis.at_fault if diagnosis is not None else []) if h != head]
        leave_out = sorted(set(lost) | set(repeat) if self.exclude_failed else set(), key=self._hosts().index)
        if lost and not self.exclude_failed:
            if self.replan is None and self.max_restarts:
                how = "trainer attach cannot leave a node out (it has not the launch's config): relaunch"
            else:
                how = "relaunch with --max-restarts K --exclude-failed"
            view.message(
                ("not restarted: " if self.max_restarts else "")
                + f"{', '.join(lost)} was lost; {how} to go on without it from the latest "
                f"checkpoint{self._checkpoint_text()}, or relaunch once it answers again"
            )
            return None
        if not self.max_restarts:
            return None
        # A probe that failed at a restart is a node loss to leave out (every lost node is, here), not a
        # failure of the job.
        free = outcome.kind == "start_failed" and bool(lost)
        if not free and self.restarts >= self.max_restarts:
            view.message(f"not restarted: all {self.max_restarts} restart(s) used (--max-restarts)")
            return None
        changes, batch = "", ""
        if leave_out:
            changed = self._leave_out(leave_out, lost)
            if changed is None:
                return None
            changes, batch = changed
            self.left_out_lost |= set(lost) & set(leave_out)
        if not free:
            self.restarts += 1
        self.launcher.new_launch()
        view.message(self._restart_line(outcome, lost, batch, free))
        if changes:
            view.log(f"  {changes}")
        return {
            "event": "restart",
            "restart": self.restarts,
            "max_restarts": self.max_restarts,
            "reason": outcome.reason,
            "cause": diagnosis.as_record() if diagnosis is not None else None,
            "failed_hosts": outcome.hosts,
            "lost": lost,
            "excluded": sorted(self.excluded),
            "resume_from": self.latest_checkpoint,
            "changes": changes,
            "batch": batch,
            "micro_batch_size": self.plan.micro_batch_size if self.plan.runs_bundled_trainer else None,
            "gradient_accumulation_steps": (
                self.plan.gradient_accumulation_steps if self.plan.runs_bundled_trainer else None
            ),
            "restart_used": not free,
            "nodes": self._nodes(),
        }

    # --- growing back (rejoin.py) ---------------------------------------------------------------------

    def _grow_back(self) -> dict[str, Any]:
        """The attempt stopped at a checkpoint, nodes left out being back: the next attempt's plan with
        them (the user's batch split where no node is left out any more), the line, its history record."""
        assert self.rejoin is not None and self.replan is not None
        back = self.rejoin.hosts_back()
        self.rejoin.taken_in(back)
        still_out = self.excluded - set(back)
        full = self.full_plan
        world = full.topology.world_size - len(still_out) * full.topology.gpus_per_node
        split = keep_batch(self.plan.effective_batch_size, full.micro_batch_size, world)
        overrides = split.overrides() if still_out and split is not None else []
        old = self.plan
        self.launcher.use_plan(self.replan(still_out, overrides))
        self.excluded, self.rejoining = still_out, back
        self.rejoins += 1
        self.launcher.new_launch()
        plan = self.plan
        batch = f"accumulation {old.gradient_accumulation_steps} -> {plan.gradient_accumulation_steps}"
        if old.micro_batch_size != plan.micro_batch_size:
            batch = f"micro batch {old.micro_batch_size} -> {plan.micro_batch_size}, {batch}"
        batch += f", effective batch {plan.effective_batch_size}" + (
            " kept" if plan.effective_batch_size == old.effective_batch_size else " (yours again)"
        )
        nodes = plan.topology.nnodes
        self.view.message(
            f"[green]{', '.join(back)} {'is' if len(back) == 1 else 'are'} back[/green]: growing to {nodes} "
            f"nodes from {self._checkpoint_name() or 'the beginning'} ({batch}); no restart used"
        )
        return {
            "event": "rejoin",
            "why": "rejoin",
            "reason": f"{', '.join(back)} back: growing to {nodes} nodes",
            "rejoin": self.rejoins,
            "rejoined": back,
            "restart": self.restarts,
            "max_restarts": self.max_restarts,
            "excluded": sorted(self.excluded),
            "resume_from": self.latest_checkpoint,
            "changes": f"{old.topology.nnodes} -> {nodes} nodes, world size {old.topology.world_size} -> "
            f"{plan.topology.world_size}",
            "batch": batch,
            "micro_batch_size": plan.micro_batch_size,
            "gradient_accumulation_steps": plan.gradient_accumulation_steps,
            "restart_used": False,
            "nodes": self._nodes(),
        }

    def _rejoin_failed(self, outcome: Outcome) -> dict[str, Any] | None:
        """The attempt that took nodes back failed at their start: they are left out again (no restart
        used) and never probed again in this launch, so a node that answers its probe but cannot start
        does not loop. The next attempt's record; {} to stop here; None when this is not that case."""
        rejoined = set(self.rejoining)
        self.rejoining = []
        failed = set(outcome.hosts) | set(outcome.lost)
        if not rejoined or outcome.kind != "start_failed" or not failed or not failed <= rejoined:
            return None
        assert self.rejoin is not None
        hosts = sorted(failed, key=self._hosts().index)
        self.rejoin.given_up |= failed
        changed = self._leave_out(hosts, [])
        if changed is None:
            return {}
        changes, batch = changed
        self.launcher.new_launch()
        self.view.message(
            f"[yellow]{', '.join(hosts)} could not start at its rejoin[/yellow] "
            f"({node_text(outcome.reason)}): left out again and not probed again in this launch; resuming "
            f"on {self.plan.topology.nnodes} nodes from {self._checkpoint_name() or 'the beginning'} "
            f"({batch}); no restart used"
        )
        return {
            "event": "restart",
            "restart": self.restarts,
            "max_restarts": self.max_restarts,
            "reason": outcome.reason,
            "cause": None,
            "failed_hosts": outcome.hosts,
            "lost": list(outcome.lost),
            "excluded": sorted(self.excluded),
            "resume_from": self.latest_checkpoint,
            "changes": changes,
            "batch": batch,
            "micro_batch_size": self.plan.micro_batch_size,
            "gradient_accumulation_steps": self.plan.gradient_accumulation_steps,
            "restart_used": False,
            "rejoin_failed": hosts,
            "nodes": self._nodes(),
        }

    # --- leaving nodes out ---------------------------------------------------------------------------

    def _leave_out(self, hosts: list[str], lost: list[str]) -> tuple[str, str] | None:
        """A new plan without `hosts`, the effective batch kept (or changed where allowed); what changed
        (nodes and world, then the batch), or None (said why) when the job cannot go on without them."""
        plan, topo, view = self.plan, self.plan.topology, self.view
        assert self.replan is not None
        new_world = topo.world_size - len(hosts) * topo.gpus_per_node
        names = ", ".join(hosts)
        overrides: list[str] = []
        batch_text = ""
        if plan.runs_bundled_trainer:
            split = split_for_world(plan, new_world, self.allow_batch_change)
            if split is None:
                effective, micro = plan.effective_batch_size, plan.micro_batch_size
                nearest = nearest_batch(effective, micro, new_world)
                view.message(
                    f"[red]not restarted[/red]: without {names} the effective batch {effective} (micro batch "
                    f"{micro} × world {topo.world_size} × accumulation {plan.gradient_accumulation_steps}) "
                    f"cannot be kept on {new_world} process(es); relaunch with --allow-batch-change to go on "
                    f"with {nearest.effective} (accumulation {nearest.accumulation}), or once {names} is back"
                )
                return None
            overrides = split.overrides()
            batch_text = split.change_from(plan)
        try:
            new_plan = self.replan(self.excluded | set(hosts), overrides)
        except PlanningError as err:
            view.message(f"[red]not restarted[/red]: without {names} the job cannot be planned: {err}")
            return None
        self.excluded |= set(hosts)
        old_ranks = {n.host: n.node_rank for n in topo.nodes}
        moved = [
            f"{n.host} is now node {n.node_rank}"
            for n in new_plan.topology.nodes
            if old_ranks[n.host] != n.node_rank
        ]
        self.launcher.use_plan(new_plan)
        why = "lost" if set(hosts) <= set(lost) else "left out"
        change = (
            f"{names} {why}: {topo.nnodes} -> {new_plan.topology.nnodes} nodes, world size "
            f"{topo.world_size} -> {new_plan.topology.world_size}"
        )
        if moved:
            change += "; " + ", ".join(moved)
        return change, batch_text

    # --- what is said ----------------------------------------------------------------------------------

    def _restart_line(self, outcome: Outcome, lost: list[str], batch: str, free: bool) -> str:
        """`restart 1 of 2: ct-worker2 lost at step 47; resuming on 2 nodes from step-40 (accumulation
        1 -> 2, effective batch 48 kept)`; a probe's failure says it used no restart instead."""
        plan = self.plan
        diagnosis = outcome.diagnosis
        at = (
            f" at step {diagnosis.at_step}" if diagnosis is not None and diagnosis.at_step is not None else ""
        )
        if lost and outcome.kind == "start_failed":
            what = f"{', '.join(lost)} did not answer its probe"
        elif lost:
            what = f"{', '.join(lost)} lost{at}"
        else:
            what = node_text(outcome.reason)
        nodes = plan.topology.nnodes
        where = f"on {nodes} node{'s' if nodes != 1 else ''}"
        if plan.runs_bundled_trainer:
            resume = (
                f"resuming {where} from {self._checkpoint_name()}"
                if self.latest_checkpoint
                else f"starting {where} from the beginning (no checkpoint was written yet)"
            )
        else:
            resume = f"relaunching your command {where} (it resumes if it reads its own checkpoints)"
        details = f" ({batch})" if batch else ""
        if free:
            return f"[yellow]{what}[/yellow]; {resume}{details}; no restart used (a lost node is left out)"
        return f"[yellow]restart {self.restarts} of {self.max_restarts}[/yellow]: {what}; {resume}{details}"

    def _say_how_to_resume(self, outcome: Outcome) -> None:
        self.view.message(
            f"[yellow]{saved_line(outcome)}[/yellow]: run the same `trainer launch` again (same --run-name) "
            f"to resume from {self._checkpoint_name() or 'it'}"
        )

    def _checkpoint_name(self) -> str:
        return checkpoint_name(self.latest_checkpoint) or self.latest_checkpoint

    def _checkpoint_text(self) -> str:
        return f" ({self._checkpoint_name()})" if self.latest_checkpoint else ""

    def _hosts(self) -> list[str]:
        return [n.host for n in self.plan.topology.nodes]

    def _nodes(self) -> dict[str, int]:
        return {n.host: n.node_rank for n in self.plan.topology.nodes}
