"""`trainer preflight -i INVENTORY`: check a cluster before a launch and name the fix for each problem.

Two passes. The probe pass (seconds): the job's topology built on the controller exactly as `trainer
launch` builds it, then one Ansible playbook (playbooks/preflight.yml next to this module, via
trainer.controller.runner) whose probes print JSON on every node; this module turns it into pass/
fail lines per host or pair. Then the DeepSpeed job (minutes): a real launch, phase by phase, never a
silent hang. The JSON report is written and the exit code is PREFLIGHT_FAILED when any check failed.
With --json the same report goes to stdout and every other line to stderr (`... --json | jq`).

Stopped at any moment (Ctrl-C, SIGTERM), preflight stops its DeepSpeed job on every node, ends the
processes its probes started there, removes its marker files and the build locks its job left, then
exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

from trainer import exitcodes
from trainer.controller.access import add_access_arguments, configure_access
from trainer.controller.preflight import bandwidth
from trainer.controller.preflight.checks import CHECKS, PROBE_CHECKS, add_skip_argument
from trainer.controller.preflight.report import FAIL, PASS, SKIP, WARN, Report, Result, format_result

DEFAULT_REPORT = Path("output/preflight.json")
DEFAULT_BANDWIDTH_GBIT = 10.0
INTERRUPTED = 130
EXAMPLES = (
    "trainer preflight -i inventory/mycluster",
    "trainer preflight -i inventory/mycluster --skip bandwidth deepspeed --json  # the report on stdout",
)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


def _bound(text: str) -> tuple[str, float]:
    from trainer.controller.preflight.deepspeed_job import BOUNDS_S

    name, sep, value = text.partition("=")
    if not sep or name not in BOUNDS_S:
        raise argparse.ArgumentTypeError(f"expected PHASE=SECONDS with PHASE one of {', '.join(BOUNDS_S)}")
    return name, _positive(value)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-i", "--inventory", required=True, help="inventory directory or file (e.g. inventory/local)"
    )
    parser.add_argument(
        "--report", type=Path, default=DEFAULT_REPORT, help=f"JSON report path (default {DEFAULT_REPORT})"
    )
    parser.add_argument(
        "--bandwidth-threshold-gbit",
        type=_positive,
        default=None,
        help="warn below this iperf3 bandwidth between two nodes (default: the inventory's "
        f"preflight_bandwidth_threshold_gbit, else {DEFAULT_BANDWIDTH_GBIT:g})",
    )
    parser.add_argument(
        "--clock-bound-s",
        type=_positive,
        default=1.0,
        help="fail when a node's clock is further than this from the head's (default 1.0)",
    )
    parser.add_argument(
        "--iperf-seconds",
        type=int,
        default=bandwidth.DEFAULT_SECONDS,
        help=f"length of each iperf3 test of the rounds (default {bandwidth.DEFAULT_SECONDS}); a pair far "
        "below the others is measured again for three times as long (at least 3 s)",
    )
    parser.add_argument(
        "--full-matrix",
        action="store_true",
        help="log in over SSH between every pair of nodes and measure iperf3 between every pair (N-1 "
        "rounds each), instead of the fast pass's O(log N) rounds of sampled peers; every pair's keys "
        "are read either way",
    )
    parser.add_argument(
        "--io-timeout",
        type=_positive,
        default=10.0,
        help="seconds a statvfs or write in the shared dir may take before the mount counts as hung "
        "(default 10)",
    )
    parser.add_argument(
        "--deepspeed-bound",
        type=_bound,
        action="append",
        default=[],
        metavar="PHASE=SECONDS",
        help="how long a phase of the DeepSpeed job may last before it counts as stalled (repeatable; "
        "see the README for the defaults)",
    )
    add_skip_argument(parser, "--skip", "checks to leave out")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the JSON report on stdout (the progress lines go to stderr), e.g. `... --json | jq`",
    )
    add_access_arguments(parser)


def _print(results: list[Result]) -> None:
    for result in results:
        print(format_result(result), flush=True)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    if not args.json:
        return _run(args, [])
    # File descriptor 1 itself goes to stderr while the checks run, so that nothing (our lines, a
    # child process's) lands between the JSON and a reader such as jq.
    sys.stdout.flush()
    json_out = os.dup(1)
    os.dup2(2, 1)
    reports: list[Report] = []
    try:
        code = _run(args, reports)
    finally:
        sys.stdout.flush()
        os.dup2(json_out, 1)
        os.close(json_out)
    if reports:
        print(json.dumps(reports[0].to_dict(), indent=2), flush=True)
    return code


def _run(args: argparse.Namespace, reports: list[Report]) -> int:
    from trainer.controller.forks import limits
    from trainer.controller.inventory import InventoryError, load_cluster

    started = time.monotonic()
    try:
        configure_access(args)  # sudo/vault passwords (trainer.controller.access)
        cluster = load_cluster(args.inventory)
    except InventoryError as err:
        print(f"trainer preflight: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    checks = [c for c in CHECKS if c not in set(args.skip)]
    # Every node runs its bandwidth rounds in one task, each round waiting on its peer's: a node past
    # the fork limit would start only once others ended, and its peers would time out waiting.
    here = limits()
    if "bandwidth" in checks and len(cluster.hosts) > here.nodes:
        print(
            f"trainer preflight: the bandwidth check runs on every node at once and this controller holds "
            f"{here.nodes} nodes at once, the cluster has {len(cluster.hosts)}. Limit: {here.binding()}; "
            "or leave the check out: --skip bandwidth",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    try:  # before any probe: a report that cannot be written is better known now
        args.report.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(
            f"trainer preflight: cannot create the report's directory {args.report.parent}: {err.strerror}",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    report = Report(inventory=str(args.inventory))
    reports.append(report)
    names = [h.name for h in cluster.hosts]
    print(
        f"preflight: {len(names)} node(s), head {cluster.head.name}"
        + (f", workers {', '.join(h.name for h in cluster.workers)}" if cluster.workers else ""),
        flush=True,
    )
    for name in args.skip:
        report.add([Result(name, "cluster", SKIP, "skipped: --skip")])

    token = secrets.token_hex(8)
    job_started: list[float] = []
    # TERM (a CI job's timeout, a supervisor) and HUP (the terminal closed) stop preflight the way
    # Ctrl-C does.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        code = _checks(cluster, checks, args, report, token, job_started)
    except KeyboardInterrupt:
        left = _clean_after_interrupt(cluster, token, job_started)
        report.duration_s = time.monotonic() - started
        report.add([Result("preflight", "cluster", FAIL, "interrupted: stopped before the end")])
        report.write(args.report)
        _say(
            f"preflight interrupted after {report.duration_s:.1f} s; "
            + (
                f"could not clean up on {left}: run it again there"
                if left
                else "nothing of it is left running"
            )
        )
        return INTERRUPTED
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code is not None:
        return code

    report.duration_s = time.monotonic() - started
    report.write(args.report)
    failed, warned = report.failed, [r for r in report.results if r.status == WARN]
    verdict = "FAILED" if failed else "passed"
    probe = f" (probe pass {report.probe_duration_s:.1f} s)" if report.probe_duration_s else ""
    print(
        f"preflight {verdict}: {len(failed)} failure(s), {len(warned)} warning(s) "
        f"in {report.duration_s:.1f} s{probe}; report: {args.report}",
        flush=True,
    )
    if failed:
        print("failing: " + ", ".join(sorted({f"{r.check} ({r.subject})" for r in failed})), flush=True)
        return exitcodes.PREFLIGHT_FAILED
    return exitcodes.OK


def _checks(
    cluster, checks: list[str], args, report: Report, token: str, job_started: list[float]
) -> int | None:
    """Both passes; None when they ran to the end (the verdict comes from the report)."""
    from trainer.controller.preflight import topology
    from trainer.controller.preflight.checks import deepspeed_blockers

    plan = None
    probe_started = time.monotonic()
    if "topology" in checks or "space" in checks:
        topology_results, plan = topology.evaluate(cluster)
        if "topology" in checks:
            _print(topology_results)
            report.add(topology_results)
    probe_checks = [c for c in checks if c in PROBE_CHECKS and c != "topology"]
    if probe_checks:
        try:
            report.add(_probe_results(cluster, probe_checks, args, report, token, plan))
        except ValueError as err:  # bad port range and the like, found before anything ran
            print(f"trainer preflight: {err}", file=sys.stderr)
            return exitcodes.CONFIG_ERROR
    report.probe_duration_s = time.monotonic() - probe_started
    print(f"preflight: probe pass done in {report.probe_duration_s:.1f} s", flush=True)
    if "deepspeed" in checks:
        blockers = deepspeed_blockers(report)
        if blockers:
            result = Result(
                "deepspeed",
                "cluster",
                SKIP,
                f"not started: it would fail or hang on what these checks found: {blockers}",
            )
            _print([result])
            report.add([result])
        else:
            report.add(_deepspeed(cluster, args, report, token, job_started))
    return None


def _deepspeed(cluster, args, report: Report, token: str, job_started: list[float]) -> list[Result]:
    from trainer.controller.preflight import deepspeed_job, probe

    ops = [r for r in report.results if r.check == "deepspeed_ops"]
    prebuilt = bool(ops) and all(r.status == PASS and "built ahead" in r.detail for r in ops)
    print("preflight: tiny DeepSpeed job (ZeRO-2) writing a checkpoint to the shared dir ...", flush=True)
    job_started.append(time.time())
    results = deepspeed_job.run_check(
        cluster,
        prebuilt=prebuilt,
        bounds=dict(args.deepspeed_bound),
        say=lambda line: print(line, flush=True),
        cleanup=lambda newer_than: probe.cleanup(cluster, token, newer_than),
    )
    _print(results)
    return results


def _say(line: str) -> None:
    """A line that must not stop a cleanup when the terminal is gone (after SIGHUP)."""
    with contextlib.suppress(OSError):
        print(line, flush=True)


def _clean_after_interrupt(cluster, token: str, job_started: list[float]) -> str:
    """End what preflight left on the nodes; the hosts it could not clean ('' when none). Ctrl-C
    again must not cut it short (it would leave processes behind)."""
    from trainer.controller.preflight import probe

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
    try:
        _say("preflight: interrupted: cleaning up on every node (wait for it) ...")
        summary = probe.cleanup(cluster, token, job_started[0] if job_started else None)
        _say(f"preflight: clean-up: {summary}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return summary.partition("(could not clean up on ")[2].rstrip(")")


def _progress():
    """Name each probe once as it runs, so a slow one (iperf3 rounds, SSH timeouts) shows where it is."""
    seen: set[str] = set()

    def on_event(event: dict) -> None:
        # The first host done with a probe, not the task start: skipped probes stay quiet.
        if event.get("event") not in ("runner_on_ok", "runner_on_failed", "runner_on_unreachable"):
            return
        name = str(event.get("event_data", {}).get("task", ""))
        if name.startswith("Preflight | ") and name not in seen:
            seen.add(name)
            print(f"  ... {name.removeprefix('Preflight | ')}", flush=True)

    return on_event


def bandwidth_threshold(cluster, cli_value: float | None) -> float:
    if cli_value is not None:
        return cli_value
    raw = cluster.head.get("preflight_bandwidth_threshold_gbit")
    try:
        value = float(raw) if raw not in (None, "") else DEFAULT_BANDWIDTH_GBIT
    except (TypeError, ValueError):
        raise ValueError(
            f"preflight_bandwidth_threshold_gbit must be a number of Gbit/s, got {raw!r}"
        ) from None
    if value <= 0:
        raise ValueError(f"preflight_bandwidth_threshold_gbit must be above 0, got {raw!r}")
    return value


def _probe_results(cluster, checks: list[str], args, report: Report, token: str, plan) -> list[Result]:
    """The probe playbook run once for `checks`, then each check judged (preflight.checks)."""
    from trainer.controller.preflight import probe
    from trainer.controller.preflight.checks import Found, judge_all, probes_for

    threshold = bandwidth_threshold(cluster, args.bandwidth_threshold_gbit)
    model_dir = str(plan.config["model"].get("name_or_path") or "") if plan is not None else ""
    print(f"preflight: probing {', '.join(checks)} ...", flush=True)
    probes = probe.run_probes(
        cluster,
        checks,
        iperf_seconds=args.iperf_seconds,
        on_event=_progress(),
        token=token,
        model_dir=model_dir,
        io_timeout_s=args.io_timeout,
        probes=probes_for(checks),
        full=args.full_matrix,
    )
    if probes.status == "timeout":
        print(
            "preflight: the probe playbook ran past its time limit and was stopped; what was measured "
            "by then is below (a node that did not answer is named by each check)",
            flush=True,
        )
    found = Found(cluster, probes, args, report, token, plan, threshold)
    results = judge_all(found, checks)
    if probes.playbook_output and not any(probes.outputs.values()) and any(r.status == FAIL for r in results):
        print("ansible output (tail):\n" + probes.playbook_output[-1500:], flush=True)
    return results
