"""`trainer preflight -i INVENTORY`: check a cluster before a launch and name the fix for each problem.

Probes run on the nodes through one Ansible playbook (playbooks/preflight.yml next to this module,
via trainer.controller.runner); this module turns what they print into pass/fail lines per host or
pair, writes the JSON report and exits PREFLIGHT_FAILED when any check failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from trainer import exitcodes
from trainer.controller.access import add_access_arguments, configure_access
from trainer.controller.preflight.report import CHECKS, FAIL, SKIP, WARN, Report, Result, format_result

DEFAULT_REPORT = Path("output/preflight.json")
#: The checks answered by the probe playbook; the DeepSpeed job runs on its own after them.
PROBE_CHECKS = tuple(check for check in CHECKS if check != "deepspeed")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return value


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
        default=10.0,
        help="warn below this iperf3 bandwidth between two nodes (default 10)",
    )
    parser.add_argument(
        "--clock-bound-s",
        type=_positive,
        default=1.0,
        help="fail when a node's clock is further than this from the head's (default 1.0)",
    )
    parser.add_argument("--iperf-seconds", type=int, default=3, help="length of each iperf3 test (default 3)")
    parser.add_argument(
        "--skip",
        nargs="+",
        action="extend",
        default=[],
        choices=CHECKS,
        metavar="CHECK",
        help=f"checks to leave out: {', '.join(CHECKS)}",
    )
    add_access_arguments(parser)


def _print(results: list[Result]) -> None:
    for result in results:
        print(format_result(result), flush=True)


def run(args: argparse.Namespace) -> int:
    from trainer.controller.inventory import InventoryError, load_cluster

    started = time.monotonic()
    try:
        configure_access(args)  # sudo/vault passwords (trainer.controller.access)
        cluster = load_cluster(args.inventory)
    except InventoryError as err:
        print(f"trainer preflight: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    checks = [c for c in CHECKS if c not in set(args.skip)]
    try:  # before any probe: a report that cannot be written is better known now
        args.report.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(
            f"trainer preflight: cannot create the report's directory {args.report.parent}: {err.strerror}",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    report = Report(inventory=str(args.inventory))
    names = [h.name for h in cluster.hosts]
    print(
        f"preflight: {len(names)} node(s), head {cluster.head.name}"
        + (f", workers {', '.join(h.name for h in cluster.workers)}" if cluster.workers else ""),
        flush=True,
    )
    for name in args.skip:
        report.add([Result(name, "cluster", SKIP, "skipped: --skip")])

    probe_checks = [c for c in checks if c in PROBE_CHECKS]
    if probe_checks:
        try:
            report.add(_probe_results(cluster, probe_checks, args, report))
        except ValueError as err:  # bad port range and the like, found before anything ran
            print(f"trainer preflight: {err}", file=sys.stderr)
            return exitcodes.CONFIG_ERROR
    if "deepspeed" in checks:
        from trainer.controller.preflight import deepspeed_job

        print("preflight: tiny DeepSpeed job (ZeRO-2) writing a checkpoint to the shared dir ...", flush=True)
        ds_results = deepspeed_job.run_check(cluster)
        _print(ds_results)
        report.add(ds_results)

    report.duration_s = time.monotonic() - started
    report.write(args.report)
    failed, warned = report.failed, [r for r in report.results if r.status == WARN]
    verdict = "FAILED" if failed else "passed"
    print(
        f"preflight {verdict}: {len(failed)} failure(s), {len(warned)} warning(s) "
        f"in {report.duration_s:.1f} s; "
        f"report: {args.report}",
        flush=True,
    )
    if failed:
        print("failing: " + ", ".join(sorted({f"{r.check} ({r.subject})" for r in failed})), flush=True)
        return exitcodes.PREFLIGHT_FAILED
    return exitcodes.OK


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


def _probe_results(cluster, checks: list[str], args, report: Report) -> list[Result]:
    from trainer.controller.preflight import bandwidth, interconnect, network, nodes, probe, ssh, storage

    print(f"preflight: probing {', '.join(checks)} ...", flush=True)
    probes = probe.run_probes(cluster, checks, iperf_seconds=args.iperf_seconds, on_event=_progress())
    results: list[Result] = []

    def missing(task):
        return lambda host: probes.why_missing(task, host)

    facts = probes.outputs.get(probe.NODE_FACTS, {})
    names = [h.name for h in cluster.hosts]
    if "ssh" in checks:
        user = str(cluster.head.get("cluster_training_user", "?"))
        results += ssh.evaluate(names, user, probes.outputs.get(probe.SSH, {}), missing(probe.SSH))
    clients = probes.outputs.get(probe.CLIENT, {})
    listener = probes.get(probe.LISTENER, cluster.head.name)
    if "master_port" in checks:
        results += network.master_port(cluster, listener, clients, missing(probe.CLIENT))
    if "ufw" in checks:
        results += network.ufw(cluster, probes.outputs.get(probe.UFW, {}), missing(probe.UFW))
    if "accelerators" in checks:
        results += nodes.accelerators(cluster, facts, missing(probe.NODE_FACTS))
    if "versions" in checks:
        results += nodes.versions(cluster, facts, missing(probe.NODE_FACTS))
    if "interconnect" in checks:
        results += interconnect.interconnect(cluster, facts, missing(probe.NODE_FACTS))
    if "clock" in checks:
        results += network.clock_results(cluster, clients, args.clock_bound_s, missing(probe.CLIENT))
    if "shared_dir" in checks:
        results += storage.shared_dir(
            cluster,
            probes.outputs.get(probe.SHARED_WRITE, {}),
            probes.get(probe.SHARED_VERIFY, cluster.head.name),
            missing(probe.SHARED_WRITE),
        )
    if "data" in checks:
        results += storage.data(cluster, facts, missing(probe.NODE_FACTS))
    _print(results)
    if "bandwidth" in checks:
        if cluster.is_single_host:
            pair_results = [Result(bandwidth.CHECK, cluster.head.name, SKIP, "skipped: one node")]
        else:
            rounds = probe.iperf_rounds(cluster)
            pair_results, report.bandwidth = bandwidth.evaluate(
                names,
                rounds,
                probes.iperf,
                probes.outputs.get(probe.IPERF_SERVER, {}),
                args.bandwidth_threshold_gbit,
                missing(probe.IPERF_CLIENT),
            )
            print(f"bandwidth: {len(rounds)} parallel round(s) for {len(names)} nodes", flush=True)
            print(bandwidth.format_matrix(names, report.bandwidth["matrix"]), flush=True)
        _print(pair_results)
        if any(r.status == WARN for r in pair_results):
            print(
                f"WARNING: bandwidth below {args.bandwidth_threshold_gbit:g} Gbit/s between some nodes: "
                + bandwidth.ZERO_ADVICE,
                flush=True,
            )
        results += pair_results
    if probes.playbook_output and not any(probes.outputs.values()) and any(r.status == FAIL for r in results):
        print("ansible output (tail):\n" + probes.playbook_output[-1500:], flush=True)
    return results
