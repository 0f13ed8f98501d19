"""`trainer launch`: the command line. It plans the job from the inventory, then hands it to the
restart policy (restarts.py), which runs attempts of the Launcher (launch.py) until the job ends or
no restart is left; `--stop` is `trainer stop` (stop.py). Kept apart from launch.py so that the
modules the command line joins (launch, restarts, stop) do not import each other. Its options for
following a launch and restarting it are `trainer attach`'s and `trainer up`'s too.
"""

from __future__ import annotations

import argparse
import functools
import signal
import sys
from collections.abc import Callable
from typing import Any

from trainer import exitcodes
from trainer.controller import forks
from trainer.controller.access import configure_access
from trainer.controller.inventory import Cluster, PlanningError, load_cluster
from trainer.controller.launcher import slurm_allocation
from trainer.controller.launcher.failure import Outcome
from trainer.controller.launcher.guest import GuestLaunch
from trainer.controller.launcher.launch import Launcher
from trainer.controller.launcher.live import LiveView
from trainer.controller.launcher.plan import (
    COMMAND_EPILOG,
    JobPlan,
    add_job_arguments,
    add_over_ssh_argument,
    plan_from_args,
)
from trainer.controller.launcher.rejoin import REJOIN_PROBE_S, Rejoin
from trainer.controller.launcher.restarts import Attempts, RestartPolicy
from trainer.controller.launcher.slurm_batch import add_slurm_arguments, slurm_option_problem
from trainer.controller.launcher.slurm_login import run_from_login
from trainer.controller.launcher.slurm_requeue import requeue_after_save
from trainer.controller.launcher.stall import STALL_FLOOR_S, STALL_STEP_FACTOR
from trainer.controller.launcher.stop import stop_run
from trainer.controller.launcher.wire import (
    LAUNCH_VARS,
    PLAYBOOKS,
    STALL_CEILING_S,
    START_SKIP_TAG,
    WatchOptions,
    launch_env,
)
from trainer.controller.launcher.world import WORLD_TIMEOUT_S
from trainer.controller.runner import PrestartedRun, prestart_playbook

#: cli.py gives this verb what follows `--` as args.command (the user's own command).
TAKES_COMMAND = True
EXAMPLES = (
    "trainer launch -i inventory/mycluster --run-name first --set train.max_steps=200",
    "trainer launch -i inventory/mycluster --run-name qwen-lora finetune-lora.yaml --max-restarts 2",
    "trainer launch -i inventory/mycluster --env WANDB_API_KEY -- bash finetune/finetune_lora_ds.sh",
    "trainer launch --slurm -i inventory/mycluster --run-name qwen --nodes 4 --time 24:00:00  # login node",
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    parser.add_argument(
        "config_file", nargs="?", metavar="CONFIG", help="trainer YAML config on this machine, as --config"
    )
    parser.epilog = COMMAND_EPILOG
    parser.add_argument(
        "--stop",
        action="store_true",
        help="stop the run's trainer on every host (e.g. after the launcher died): `trainer stop`",
    )
    add_over_ssh_argument(parser)
    add_slurm_arguments(parser)
    add_watch_arguments(parser)
    add_restart_arguments(parser)


def replanner(args: argparse.Namespace, cluster: Cluster) -> Callable[[set[str], list[str]], JobPlan]:
    """The plan again, from the same command line, without some hosts and with more --set."""
    return lambda excluded, extra: plan_from_args(args, cluster, excluded, extra)


def restart_policy(
    args: argparse.Namespace,
    cluster: Cluster,
    launcher: Attempts,
    view: LiveView,
    rejoin: Rejoin | None = None,
    after_saved: Callable[[Outcome], None] | None = None,
) -> RestartPolicy:
    """The restart policy the command line asks for, above `launcher`'s attempts: the SSH Launcher's
    or a Slurm allocation's steps (guest.py) alike."""
    return RestartPolicy(
        launcher,
        view,
        max_restarts=args.max_restarts,
        exclude_failed=args.exclude_failed,
        allow_batch_change=args.allow_batch_change,
        replan=replanner(args, cluster),
        inventory=str(args.inventory),
        rejoin=rejoin,
        after_saved=after_saved,
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "config_file", None):  # `trainer launch -i INV CONFIG`, as `trainer train CONFIG`
        if args.config and args.config != args.config_file:
            print(
                f"trainer launch: two config files given ({args.config_file} and --config {args.config}); "
                "give one",
                file=sys.stderr,
            )
            return exitcodes.CONFIG_ERROR
        args.config = args.config_file
    job = slurm_allocation.allocation_job()
    if problem := option_problem(args) or slurm_option_problem(args, job):
        print(f"trainer launch: {problem}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if job is not None and not args.over_ssh:
        return run_in_allocation(args, job)
    if args.slurm and not args.stop:  # a login node: one batch job, followed from here (slurm_login.py)
        view = LiveView()
        install_signal_handlers(view)
        return run_from_login(args, view)
    early: PrestartedRun | None = None
    try:
        try:
            configure_access(args)  # sudo/vault passwords (trainer.controller.access)
            if not args.stop and not args.force:  # --force takes the lock over first (lock.yml)
                early = prestart(args)
            # Loaded once: a restart that leaves a node out plans again from the same inventory.
            cluster = load_cluster(args.inventory)
            plan = plan_from_args(args, cluster)
        except PlanningError as err:
            print(f"trainer launch: {err}", file=sys.stderr)
            return exitcodes.CONFIG_ERROR
        if args.stop:
            options = watch_options(args, plan.runs_bundled_trainer)
            return stop_run(cluster, args.run_name, options, "trainer launch --stop")
        if problem := follow_problem(plan.topology.nnodes):
            print(f"trainer launch: {problem}", file=sys.stderr)
            return exitcodes.CONFIG_ERROR
        options = watch_options(args, plan.runs_bundled_trainer)
        launcher = Launcher(plan, options, prestarted=early)
        view = LiveView()
        install_signal_handlers(view)
        rejoin = None
        if not args.no_rejoin:
            rejoin = Rejoin(plan, options, view, interval_s=args.rejoin_probe_interval)
        return restart_policy(args, cluster, launcher, view, rejoin).run(force=args.force)
    finally:
        if early is not None:
            early.cancel()  # unused (an error, an interrupt): its ansible-playbook waits for nothing


def run_in_allocation(args: argparse.Namespace, job: str) -> int:
    """`trainer launch` inside the Slurm allocation `job`: the job on the allocation's nodes as one
    step of it (guest.py), the rest from the inventory and the command line as over SSH."""
    try:
        configure_access(args)  # vault passwords (trainer.controller.access)
        cluster = slurm_allocation.allocation_cluster(args.inventory)
        plan = plan_from_args(args, cluster)
    except PlanningError as err:
        print(f"trainer launch: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if args.stop:
        return stop_run(
            cluster, args.run_name, watch_options(args, plan.runs_bundled_trainer), "trainer launch --stop"
        )
    view = LiveView()
    install_signal_handlers(view)
    # The trainer's save-and-stop request (trainer.node.save_request): a `--signal=B:USR2` or `scancel
    # --full` that reaches this batch shell too must not end the launcher that follows the run.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    # The same policy as over SSH, above attempts that are Slurm steps: a restart is a new step, a node
    # left out is left off the next step's node list. No rejoin here yet.
    if args.exclude_failed and not args.no_rejoin:
        view.log("note: a node left out is not taken back inside a Slurm allocation (no rejoin there yet)")
    launcher = GuestLaunch(plan, watch_options(args, plan.runs_bundled_trainer), job)
    # A run stopped at a checkpoint by Slurm's warning signal: the job is requeued (slurm_requeue.py).
    requeue = functools.partial(requeue_after_save, plan, job, view)
    return restart_policy(args, cluster, launcher, view, after_saved=requeue).run(force=args.force)


# --- the options and helpers `trainer attach` and `trainer up` share ------------------------------


def follow_problem(nodes: int) -> str | None:
    """Why this controller cannot follow `nodes` nodes at once (and so refuses the launch), or None."""
    return forks.limits().follow_problem(nodes)


def add_watch_arguments(parser: argparse.ArgumentParser) -> None:
    """How a launch is followed: shared by `trainer launch` and `trainer attach`."""
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=None,
        help="seconds between status polls of each node, on average: a poll answers as soon as there "
        "are new lines, and up to 3 may follow back to back (default: 2)",
    )
    parser.add_argument(
        "--unreachable-grace",
        type=float,
        default=None,
        metavar="S",
        help="a node that does not answer is shown as unreachable and failed only after S seconds; its "
        "trainer keeps running meanwhile (default: 60)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        metavar="S",
        help="stop every node when no rank advances a step (bundled trainer; counted from its ranks' "
        "first report) or no node prints a line "
        "(your command) for S seconds, naming the ranks behind, or by its process state a rank stopped, "
        "blocked in the kernel or gone while its peers wait (exit 71) (default for the bundled trainer: "
        f"{STALL_STEP_FACTOR:g} × its slowest step, at least {STALL_FLOOR_S:g} s; "
        f"{STALL_CEILING_S:g} s before its steps' times are known, during an evaluation or "
        "a checkpoint save, and while a rank computes a long step; for your command: no line and no rank "
        f"using CPU or I/O for {STALL_FLOOR_S:g} s stops it only with a culprit named, "
        f"{STALL_CEILING_S:g} s in any case; 0: off)",
    )
    parser.add_argument(
        "--stop-grace",
        type=float,
        default=None,
        help="seconds a stopped trainer gets between TERM and KILL (default: 10)",
    )
    parser.add_argument(
        "--world-timeout",
        type=float,
        default=None,
        metavar="S",
        help="your command on several nodes: a node that runs S seconds without connecting to the head "
        "formed a job of its own; the job is stopped (exit 2) when the command starts torchrun, "
        f"accelerate or deepspeed, else a warning is shown (default: {WORLD_TIMEOUT_S:g})",
    )


def watch_options(args: argparse.Namespace, bundled: bool, saved: WatchOptions | None = None) -> WatchOptions:
    """The command line's watch settings; what it leaves out from `saved` (the launch's own, from its
    launch.json), else the defaults for a job of its kind."""
    base = saved or WatchOptions.defaults(bundled)

    def pick(arg: float | None, kept: float | None) -> float | None:
        return arg if arg is not None else kept

    stall = pick(args.stall_timeout, base.stall_timeout_s)
    # Adaptive unless the command line gave a bound (or the launch being attached to was given one).
    adaptive = args.stall_timeout is None and base.stall_adaptive
    return WatchOptions(
        poll_interval_s=float(pick(args.poll_interval, base.poll_interval_s)),
        unreachable_grace_s=float(pick(args.unreachable_grace, base.unreachable_grace_s)),
        stall_timeout_s=float(stall) if stall else None,
        stall_adaptive=adaptive and bool(stall),
        stop_grace_s=float(pick(args.stop_grace, base.stop_grace_s)),
        world_timeout_s=float(pick(args.world_timeout, base.world_timeout_s)),
    )


def add_restart_arguments(parser: argparse.ArgumentParser) -> None:
    """What happens after a failure: shared by `trainer launch` and `trainer up` (option_problem checks
    how they combine)."""
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="after a failure (a rank's exit, a lost node, a GPU fault, a stall), stop every node and start "
        "again, up to K times; the bundled trainer resumes from the latest complete checkpoint. Bad input "
        "(exit 2 config, 3 data sizing, 74 disk full) is never restarted (default: 0)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="take over the run's lock left by a launcher that died (kill -9, a lost controller); "
        "refused while that launcher still runs on this controller",
    )
    parser.add_argument(
        "--exclude-failed",
        action="store_true",
        help="with --max-restarts: leave out a lost node at once (it stopped answering while its peers "
        "failed, or at its probe; this uses no restart) and a node that caused two failures, and go on "
        "on the others from the latest checkpoint, the effective batch kept (gradient accumulation raised)",
    )
    parser.add_argument(
        "--allow-batch-change",
        action="store_true",
        help="with --exclude-failed: when the remaining processes cannot divide the effective batch, go on "
        "with the nearest one instead of stopping",
    )
    parser.add_argument(
        "--no-rejoin",
        action="store_true",
        help="with --exclude-failed: a node left out stays out until the run ends. By default the nodes "
        "left out are probed while the job goes on without them, and one that answers its probe again "
        "(the start's own checks) is taken back at the bundled trainer's next checkpoint: the job stops "
        "there and starts again on all the nodes with your batch split, which uses no restart",
    )
    parser.add_argument(
        "--rejoin-probe-interval",
        type=float,
        default=REJOIN_PROBE_S,
        metavar="S",
        help="with --exclude-failed: seconds between two probes of the nodes left out (one Ansible run for "
        f"all of them) (default: {REJOIN_PROBE_S:g})",
    )


def prestart(args: argparse.Namespace) -> PrestartedRun | None:
    """start.yml, started before the inventory is read and the plan made: ansible-playbook's own
    start (a second) overlaps with them. Its command line is the same for every plan (start.yml's
    header); the first attempt hands it the plan's variables (runner.PrestartedRun)."""
    try:
        return prestart_playbook(
            PLAYBOOKS / "start.yml",
            args.inventory,
            LAUNCH_VARS,
            env=launch_env(),
            skip_tags=START_SKIP_TAG,
            channel=True,
        )
    except OSError:
        return None  # an unreadable inventory path: the plan says what is wrong with it


def option_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with how the restart options combine (add_restart_arguments), or None."""
    if args.max_restarts < 0:
        return "--max-restarts must be 0 or more"
    if args.exclude_failed and not args.max_restarts:
        return "--exclude-failed needs --max-restarts K (K >= 1)"
    if args.allow_batch_change and not args.exclude_failed:
        return "--allow-batch-change needs --exclude-failed"
    if args.no_rejoin and not args.exclude_failed:
        return "--no-rejoin needs --exclude-failed (without it no node is left out to come back)"
    if not args.rejoin_probe_interval > 0:
        return f"--rejoin-probe-interval must be more than 0 seconds (got {args.rejoin_probe_interval:g})"
    return None


def install_signal_handlers(view: LiveView) -> None:
    """TERM (a CI job's timeout, a supervisor) and HUP (the terminal closed) stop the hosts' trainers
    the way Ctrl-C does. After HUP there is no terminal to write to: output is dropped."""

    def interrupt(signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:
            view.detach()
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)
