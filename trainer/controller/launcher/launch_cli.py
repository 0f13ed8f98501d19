"""`trainer launch`: the command line. It plans the job from the inventory, then hands it to the
restart policy (restarts.py), which runs attempts of the Launcher (launch.py) until the job ends or
no restart is left; `--stop` is `trainer stop` (stop.py). Kept apart from launch.py so that the
modules the command line joins (launch, restarts, stop) do not import each other.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from trainer import exitcodes
from trainer.controller.access import configure_access
from trainer.controller.inventory import Cluster, PlanningError, load_cluster
from trainer.controller.launcher.launch import (
    Launcher,
    add_restart_arguments,
    add_watch_arguments,
    follow_problem,
    install_signal_handlers,
    option_problem,
    prestart,
    watch_options,
)
from trainer.controller.launcher.live import LiveView
from trainer.controller.launcher.plan import COMMAND_EPILOG, JobPlan, add_job_arguments, plan_from_args
from trainer.controller.launcher.restarts import RestartPolicy
from trainer.controller.launcher.stop import stop_run
from trainer.controller.runner import PrestartedRun

#: cli.py gives this verb what follows `--` as args.command (the user's own command).
TAKES_COMMAND = True
EXAMPLES = (
    "trainer launch -i inventory/mycluster --run-name first --set train.max_steps=200",
    "trainer launch -i inventory/mycluster --run-name qwen-lora finetune-lora.yaml --max-restarts 2",
    "trainer launch -i inventory/mycluster --env WANDB_API_KEY -- bash finetune/finetune_lora_ds.sh",
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
    add_watch_arguments(parser)
    add_restart_arguments(parser)


def replanner(args: argparse.Namespace, cluster: Cluster) -> Callable[[set[str], list[str]], JobPlan]:
    """The plan again, from the same command line, without some hosts and with more --set."""
    return lambda excluded, extra: plan_from_args(args, cluster, excluded, extra)


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
    if problem := option_problem(args):
        print(f"trainer launch: {problem}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
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
        launcher = Launcher(plan, watch_options(args, plan.runs_bundled_trainer), prestarted=early)
        view = LiveView()
        install_signal_handlers(view)
        policy = RestartPolicy(
            launcher,
            view,
            max_restarts=args.max_restarts,
            exclude_failed=args.exclude_failed,
            allow_batch_change=args.allow_batch_change,
            replan=replanner(args, cluster),
            inventory=str(args.inventory),
        )
        return policy.run(force=args.force)
    finally:
        if early is not None:
            early.cancel()  # unused (an error, an interrupt): its ansible-playbook waits for nothing
