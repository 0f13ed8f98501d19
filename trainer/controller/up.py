"""`trainer up -i INVENTORY [launch options] [-- COMMAND]`: from bare hosts to the first step in one command.

Policy only: three phases, each done by the code its own command uses, in order:

1. provision: this checkout's site.yml through trainer.controller.runner, as `make provision` runs it;
   on a cluster that is as the last full run left it, the converged check skips the roles after one
   round trip per node (roles/converged/README.md);
2. preflight: the probe pass of `trainer preflight` (every check but the DeepSpeed job);
3. launch: `trainer launch` with the same options (plan.add_job_arguments and launch's own pieces).

Before any phase, the inventory is read and checked with site.yml's rules and the job planned as the
launch will plan it: bad input is refused with exit 2 and nothing is contacted. Each phase's wall time
is printed as it ends and again in a summary. A failing phase stops `up` there, after its own report,
with that phase's exit code and the command that runs again from it (`--from PHASE`).
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trainer
from trainer import exitcodes
from trainer.controller import inventory_rules
from trainer.controller.access import configure_access
from trainer.controller.inventory import (
    CLUSTER_GROUP,
    HEAD_GROUP,
    WORKERS_GROUP,
    Cluster,
    InventoryError,
    PlanningError,
    load_cluster,
    refuse_problems,
)
from trainer.controller.launcher import launch_cli, slurm_batch
from trainer.controller.launcher.plan import JobPlan, add_job_arguments, plan_from_args
from trainer.controller.preflight.checks import add_skip_argument
from trainer.redaction import REDACTED, redact_override, secret_env

PHASES = ("provision", "preflight", "launch")
#: cli.py gives this verb what follows `--` as args.command (the user's own command, for the launch).
TAKES_COMMAND = True
#: The task of site.yml's probe play that says whether the roles run and why (roles/converged).
CONVERGED_SAY_TASK = "Say whether the roles run, and why"
CONVERGED_DECIDE_TASK = "Decide whether the roles have anything to do"
#: The part of preflight `up` runs: the probe pass (seconds). The DeepSpeed job (minutes: a real launch
#: that compiles and checkpoints) is left to `trainer preflight`, and the launch follows at once anyway.
PREFLIGHT_SKIPPED = ("deepspeed",)

#: The lines `trainer up --help` ends with (cli.py), each as typed, what it does after `#`.
EXAMPLES = (
    "trainer up -i inventory/local --set train.max_steps=20  # this machine: provision, check, train",
    "trainer up -i inventory/mycluster --run-name exp1 -- bash finetune/finetune_lora_ds.sh  # your command",
    "trainer up -i inventory/mycluster --run-name exp1 --from launch  # after a failed launch: launch again",
    "trainer up -i inventory/mycluster --full  # every role, even where the converged check would skip them",
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    launch_cli.add_watch_arguments(parser)
    launch_cli.add_restart_arguments(parser)
    group = parser.add_argument_group("phases")
    group.add_argument(
        "--from",
        dest="from_phase",
        choices=PHASES,
        default=PHASES[0],
        help="start at this phase, leaving out the ones before it (a failed phase prints the command "
        "with it; default: %(default)s)",
    )
    group.add_argument(
        "--full",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--full: run every role even on a cluster as the last full run left it "
        "(-e converged_full_run=true, make provision FULL=1); --no-full: skip the roles there even where "
        "the inventory sets converged_full_run: true (the test bed's); default: the inventory's setting",
    )
    add_skip_argument(group, "--preflight-skip", "preflight checks to leave out besides the DeepSpeed job")
    group.add_argument(
        "--preflight-report",
        type=Path,
        default=None,
        metavar="FILE",
        help="preflight's JSON report (default: trainer preflight's)",
    )


@dataclass
class PhaseResult:
    name: str
    code: int | None = None
    """The phase's exit code; None: not run (left out with --from, or after a failure)."""
    seconds: float = 0.0
    note: str = ""


def say(line: str) -> None:
    print(f"up: {line}", flush=True)


def run(args: argparse.Namespace) -> int:
    """The three phases in order, or the first error (exit 2) before any of them."""
    if problem := launch_cli.option_problem(args):
        print(f"trainer up: {problem}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    start_at = PHASES.index(args.from_phase)
    try:
        configure_access(args)  # sudo/vault passwords: asked once, used by every phase
        cluster = load_cluster(args.inventory)
        site = site_playbook() if start_at == 0 else None
        if start_at == 0:
            check_provisioning_rules(cluster)
        preflight_args = preflight_arguments(args)
        plan = plan_from_args(args, cluster)
    except PlanningError as err:
        print(f"trainer up: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    say(describe(plan, start_at))
    phases: dict[str, Callable[[], tuple[int, str]]] = {
        "preflight": lambda: preflight(preflight_args),
        "launch": lambda: launch_job(args),
    }
    if site is not None:  # found whenever up starts at provisioning
        phases["provision"] = lambda: provision(site, args)
    results = [
        PhaseResult(name, note="left out (--from)" if i < start_at else "") for i, name in enumerate(PHASES)
    ]
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    started = time.monotonic()
    try:
        for result in results[start_at:]:
            say(f"{result.name} ...")
            begun = time.monotonic()
            try:
                result.code, result.note = phases[result.name]()
            except KeyboardInterrupt:
                result.code, result.note = exitcodes.INTERRUPTED, "interrupted"
            result.seconds = time.monotonic() - begun
            say(f"{result.name} {'done' if result.code == 0 else 'FAILED'} in {result.seconds:.1f} s"
                + (f": {result.note}" if result.note else ""))  # fmt: skip
            if result.code != 0:
                summary(results, time.monotonic() - started)
                say(f"stopped at {result.name} (exit {result.code}); to run again from there: "
                    + rerun_command(args, result.name))  # fmt: skip
                return result.code
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    summary(results, time.monotonic() - started)
    return exitcodes.OK


def _interrupt(signum: int, frame: Any) -> None:
    # TERM (a CI job's timeout) and HUP (the terminal closed) end the phase the way Ctrl-C does: the
    # runner ends ansible-playbook, preflight and launch stop what they started on the nodes.
    raise KeyboardInterrupt(f"signal {signum}")


def describe(plan: JobPlan, start_at: int) -> str:
    topo = plan.topology
    what = "your command" if plan.user_command else f"the bundled trainer ({plan.engine})"
    hosts = ", ".join(node.host for node in topo.nodes)
    phases = " -> ".join(PHASES[start_at:])
    return f"{phases} on {len(topo.nodes)} node(s) ({hosts}); run {plan.run_name}: {what}"


def summary(results: list[PhaseResult], total: float) -> None:
    print("up: phase times", flush=True)
    for result in results:
        if result.code is None:
            shown = f"{'-':>8}    {result.note or 'not run'}"
        else:
            outcome = "ok" if result.code == 0 else f"exit {result.code}"
            shown = f"{result.seconds:7.1f} s  {outcome}" + (f"; {result.note}" if result.note else "")
        print(f"  {result.name:<10} {shown}", flush=True)
    print(f"  {'total':<10} {total:7.1f} s", flush=True)


# --- input checks, before any phase -------------------------------------------------------------


def site_playbook() -> Path:
    """The site.yml of the clustertrain checkout this trainer package is part of, and no other.

    Never the working directory's: run inside another Ansible project (or a directory someone else
    prepared), `up` would apply that project's playbook as root to every node. A package installed
    from a wheel has no checkout beside it, and is refused with the fix."""
    root = Path(trainer.__file__).resolve().parents[1]
    if all(
        (root / part).exists()
        for part in ("site.yml", "playbooks/site.yml", "roles/trainer_env", "pyproject.toml")
    ):
        return root / "site.yml"
    raise InventoryError(
        f"trainer up provisions with the site.yml of the clustertrain checkout its package is part of, and "
        f"this trainer package ({root / 'trainer'}) is not in one (a wheel install); the current "
        "directory's site.yml is never used. Fix: install the trainer from its checkout (`make install` "
        "there, or `pip install -e CHECKOUT`), or give --from preflight on a cluster already provisioned"
    )


def check_provisioning_rules(cluster: Cluster) -> None:
    """site.yml's own inventory rules (trainer.controller.inventory_rules, PROVISION: stricter than a
    launch's), applied here so a problem only provisioning has stops `up` before any phase starts."""
    hostvars = {host.name: host.vars for host in cluster.hosts}
    groups = {
        CLUSTER_GROUP: list(hostvars),
        HEAD_GROUP: [cluster.head.name],
        WORKERS_GROUP: [host.name for host in cluster.workers],
    }
    problems = inventory_rules.cluster_problems(hostvars, groups, inventory_rules.PROVISION)
    refuse_problems(cluster.inventory, problems, refuser="site.yml")


def preflight_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """`trainer preflight`'s own options for its probe pass, parsed by its own parser (its defaults
    stay its own); the password options are this command's."""
    from trainer.controller.preflight import cli as preflight_cli

    parser = argparse.ArgumentParser(prog="trainer up (preflight)")
    preflight_cli.configure_parser(parser)
    argv = ["-i", str(args.inventory), "--skip", *PREFLIGHT_SKIPPED, *args.preflight_skip]
    if args.preflight_report is not None:
        argv += ["--report", str(args.preflight_report)]
    preflight_args = parser.parse_args(argv)  # up's parser took the same check names
    for name in ("ask_become_pass", "become_password_file", "vault_password_files"):
        setattr(preflight_args, name, getattr(args, name))
    return preflight_args


# --- the phases ----------------------------------------------------------------------------------


def provision(site: Path, args: argparse.Namespace) -> tuple[int, str]:
    """site.yml through the runner, each play named as it starts; the first failure named at the end."""
    from trainer.controller.provision_times import ProvisionClock
    from trainer.controller.runner import run_playbook

    extravars = {} if args.full is None else {"converged_full_run": bool(args.full)}
    clock = ProvisionClock()

    def on_event(event: dict[str, Any]) -> None:
        clock.on_event(event)
        if event.get("event") == "playbook_on_play_start":
            print(f"  ... {event.get('event_data', {}).get('play', '')}", flush=True)

    result = run_playbook(site, args.inventory, extravars=extravars, on_event=on_event)
    print("  where the provision's time went:", flush=True)
    for line in clock.lines():
        print(f"  {line}", flush=True)
    changed = sum(int(n) for n in result.stats.get("changed", {}).values())
    said = next(
        (
            item.result.get("msg")
            for item in result.results
            if item.task == CONVERGED_SAY_TASK and item.status == "ok"
        ),
        None,
    )
    if said:
        print(f"  {' '.join(str(said).split())}", flush=True)
    if not result.succeeded:
        failure = result.first_failure
        if failure is not None:
            print(f"  failed: {failure.host}: {failure.task}: {failure.message}", flush=True)
        elif result.output:
            print(result.output.rstrip(), flush=True)  # ansible-playbook's own words (a syntax error)
        # ansible-playbook's code (2: a host failed, 4: unreachable) would read as our CONFIG_ERROR
        # (nothing changed), which a half-provisioned cluster is not.
        return exitcodes.FAILURE, f"site.yml failed (ansible-playbook exit {result.rc})"
    skipped = any(
        item.result.get("ansible_facts", {}).get("converged_cluster") in (True, "True", "true")
        for item in result.results
        if item.task == CONVERGED_DECIDE_TASK and item.status == "ok"
    )
    return exitcodes.OK, "converged: the roles were skipped" if skipped else f"changed={changed}"


def preflight(preflight_args: argparse.Namespace) -> tuple[int, str]:
    from trainer.controller.preflight import cli as preflight_cli

    code = preflight_cli.run(preflight_args)
    return code, f"probe pass (no DeepSpeed job); report {preflight_args.report}"


def launch_job(args: argparse.Namespace) -> tuple[int, str]:
    args.stop = False  # `trainer launch`'s options, less --stop (`up` starts a job, never stops one)
    # ... and less --slurm and the job's size (`up` provisions and launches over SSH): off.
    for name, value in slurm_batch.slurm_defaults().items():
        setattr(args, name, value)
    code = launch_cli.run(args)
    return code, "finished" if code == 0 else ""


def rerun_command(args: argparse.Namespace, phase: str) -> str:
    """This command again from `phase`: the words it was given (secret values redacted), its --from
    replaced."""
    argv = sys.argv[1:]
    if argv[:1] != ["up"]:  # called in another way (a test's main()): the options that matter most
        argv = ["up", "-i", str(args.inventory), "--run-name", args.run_name]
        argv += [word for item in args.overrides for word in ("--set", item)]
        argv += ["--", *args.command] if args.command else []
    words, command = argv[1:], []
    if "--" in words:
        split = words.index("--")
        words, command = words[:split], words[split:]
    kept: list[str] = []
    for i, word in enumerate(words):
        previous = words[i - 1] if i else ""
        if word == "--from" or word.startswith("--from=") or previous == "--from":
            continue
        if word.startswith(("--set=", "--env=")):
            option, _, value = word.partition("=")
            kept.append(f"{option}={_shown(option, value)}")
        else:
            kept.append(_shown(previous, word) if previous in ("--set", "--env") else word)
    return shlex.join(["trainer", "up", *kept, "--from", phase, *command])


def _shown(option: str, value: str) -> str:
    """A --set or --env value as it may be printed: a secret's value redacted (as launch shows them)."""
    if option == "--set":
        return redact_override(value)
    name, has_value, text = value.partition("=")
    return f"{name}={REDACTED}" if has_value and secret_env(name, text) else value
