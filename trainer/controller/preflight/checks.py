"""Every preflight check in one registry: its name, what it looks at, the probes it reads and how it
judges them. A new check is one `Check` here (with its judge in a module of its own and, if it needs
a new probe, a task in playbooks/preflight.yml), plus its heading and fixes in docs/preflight.md.

A check's name is what `--skip` takes, the `check` field of its results in the report and its heading
in docs/preflight.md. The registry's order is the run order: `topology` on the controller first (it
builds the job every other check measures against), then the checks answered by the probe playbook
(one run, seconds), `deepspeed` (a real job, minutes) last. The two ends run as their own phases
(preflight.cli); the probe checks are judged here, in order, from what the probe playbook found.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.controller.inventory import Cluster
from trainer.controller.preflight import (
    bandwidth,
    extensions,
    interconnect,
    interfaces,
    network,
    nfs,
    nodes,
    probe,
    schedule,
    space,
    ssh,
    storage,
)
from trainer.controller.preflight.report import SKIP, WARN, Report, Result, format_result


@dataclass
class Found:
    """What a judge sees: the cluster, the probe playbook's output, the options and the planned job."""

    cluster: Cluster
    probes: probe.Probes
    args: Any
    """preflight's command-line options (clock bound, iperf seconds, I/O timeout)."""
    report: Report
    token: str
    plan: Any
    """The job `trainer launch` would start (topology's JobPlan), None when topology found it unplannable."""
    bandwidth_threshold_gbit: float

    def missing(self, task: str) -> Callable[[str], str]:
        """host -> why `task` left no output there."""
        return lambda host: self.probes.why_missing(task, host)

    def output(self, task: str) -> dict[str, Any]:
        """host -> what `task` printed there."""
        return self.probes.outputs.get(task, {})

    @property
    def facts(self) -> dict[str, Any]:
        return self.output(probe.NODE_FACTS)


@dataclass(frozen=True)
class Check:
    name: str
    """What `--skip` takes, the report's `check` field and the check's heading in docs/preflight.md."""
    looks_at: str
    """What it probes, in one line (docs/preflight.md says more, with every fix)."""
    reads: tuple[str, ...] = ()
    """The probe playbook's tasks (probe.NODE_FACTS, ...) it needs: those whose output it judges, and
    what they need to run. The playbook runs a task only when a check to run reads it (probes_for)."""
    judge: Callable[[Found], list[Result]] | None = None
    """How it judges what the probes found; None for the two run as phases of their own."""
    blocks_deepspeed: bool = False
    """A failure here makes the DeepSpeed job pointless: it could only fail or hang on it."""
    prints_own_lines: bool = False
    """The judge prints its verdicts itself, among lines of its own (bandwidth's matrix)."""


def _ssh(found: Found) -> list[Result]:
    cluster = found.cluster
    user = str(cluster.head.get("cluster_training_user", "?"))
    names = [h.name for h in cluster.hosts]
    addresses = {h.name: h.address for h in cluster.hosts}
    full = bool(getattr(found.args, "full_matrix", False))
    results, found.report.ssh = ssh.evaluate(
        names, addresses, user, found.output(probe.SSH), found.missing(probe.SSH), full
    )
    if len(names) > 1:
        numbers = found.report.ssh
        print(
            f"ssh: {numbers['logins']} login(s) ({numbers['mode']}: "
            f"{len(schedule.login_offsets(len(names), full))} round(s)), every pair's keys read from both "
            f"ends; at most {numbers['logins_per_sshd']} login(s) per sshd, "
            f"{len(numbers['retried'])} retried",
            flush=True,
        )
    return results


def _master_port(found: Found) -> list[Result]:
    listener = found.probes.get(probe.LISTENER, found.cluster.head.name)
    return network.master_port(
        found.cluster, listener, found.output(probe.CLIENT), found.missing(probe.CLIENT)
    )


def _ufw(found: Found) -> list[Result]:
    return network.ufw(found.cluster, found.output(probe.UFW), found.missing(probe.UFW))


def _on_facts(evaluate: Callable[[Cluster, dict[str, Any], Callable[[str], str]], list[Result]]):
    """The judge of a check that reads only the node facts: evaluate(cluster, facts, why_missing)."""
    return lambda found: evaluate(found.cluster, found.facts, found.missing(probe.NODE_FACTS))


def _clock(found: Found) -> list[Result]:
    return network.clock_results(
        found.cluster,
        found.output(probe.CLIENT),
        found.facts,
        found.args.clock_bound_s,
        found.missing(probe.CLIENT),
        found.missing(probe.NODE_FACTS),
    )


def _shared_dir(found: Found) -> list[Result]:
    return storage.shared_dir(
        found.cluster,
        found.facts,
        found.probes.get(probe.SHARED_VERIFY, found.cluster.head.name),
        found.missing(probe.NODE_FACTS),
        found.missing(probe.SHARED_VERIFY),
    )


def _space(found: Found) -> list[Result]:
    return space.evaluate(found.cluster, found.plan, found.facts, found.missing(probe.NODE_FACTS))


def _bandwidth(found: Found) -> list[Result]:
    """iperf3 between every pair in parallel rounds; a link far below the others is measured again
    (one slow test on a busy host is noise, a bad link is slow both times). Prints its matrix, its
    verdicts and, for a link below the threshold, what that costs and what to do."""
    results = _bandwidth_verdicts(found)
    _print(results)
    threshold = found.bandwidth_threshold_gbit
    if any(r.status == WARN and "below" in r.detail and "median" not in r.detail for r in results):
        print(
            f"WARNING: bandwidth below {threshold:g} Gbit/s between some nodes: " + bandwidth.ZERO_ADVICE,
            flush=True,
        )
    return results


def _bandwidth_verdicts(found: Found) -> list[Result]:
    cluster = found.cluster
    if cluster.is_single_host:
        return [Result(bandwidth.CHECK, cluster.head.name, SKIP, "skipped: one node")]
    names = [h.name for h in cluster.hosts]
    rounds = probe.iperf_rounds(cluster, bool(getattr(found.args, "full_matrix", False)))
    servers = found.output(probe.IPERF_SERVER)
    measured = bandwidth.measure(rounds, found.probes.iperf, servers, found.missing(probe.IPERF_TEST))
    again, measured_again = _measure_again(found, measured, rounds)
    results, found.report.bandwidth = bandwidth.evaluate(
        names, rounds, measured.better_of(measured_again), found.bandwidth_threshold_gbit, again, measured
    )
    pairs = sum(len(r["pairs"]) for r in rounds)
    print(
        f"bandwidth: {len(rounds)} parallel round(s) for {len(names)} nodes, {pairs} of "
        f"{len(names) * (len(names) - 1) // 2} pairs (--full-matrix: every pair)",
        flush=True,
    )
    print(bandwidth.format_matrix(names, found.report.bandwidth["matrix"]), flush=True)
    return results


def _measure_again(found: Found, measured, rounds: list[dict]):
    """(rounds, what they measured) for the pairs with a link far below the others, measured once more."""
    again = bandwidth.retest_rounds(measured, rounds, found.bandwidth_threshold_gbit)
    if not again:
        return [], bandwidth.Measured()
    pairs = ", ".join(f"{p['client']} <-> {p['server']}" for r in again for p in r["pairs"])
    args = found.args
    seconds = bandwidth.retest_seconds(args.iperf_seconds)
    print(
        f"  ... iperf3 again for {pairs} ({seconds} s each): far below the other links or the threshold",
        flush=True,
    )
    # Only the hosts of these pairs: the others would only log in and skip.
    hosts = sorted({p[end] for r in again for p in r["pairs"] for end in ("client", "server")})
    probes = probe.run_probes(
        found.cluster,
        ["bandwidth"],
        seconds,
        probes=probes_for(["bandwidth"]),
        token=found.token,
        io_timeout_s=args.io_timeout,
        rounds=again,
        limit=hosts,
    )
    servers = probes.outputs.get(probe.IPERF_SERVER, {})
    return again, bandwidth.measure(
        again, probes.iperf, servers, lambda host: probes.why_missing(probe.IPERF_TEST, host)
    )


FACTS = (probe.NODE_FACTS,)

REGISTRY: tuple[Check, ...] = (
    Check(
        "topology",
        looks_at="the job trainer launch would start, built on the controller",
        blocks_deepspeed=True,
    ),
    Check(
        "ssh",
        looks_at="SSH trust between every pair of nodes as the training user: keys, then sampled logins",
        reads=(probe.SSH,),
        judge=_ssh,
    ),
    Check(
        "master_port",
        looks_at="the master port reachable from every worker",
        reads=(probe.LISTENER, probe.CLIENT),
        judge=_master_port,
        blocks_deepspeed=True,
    ),
    Check(
        "ufw",
        looks_at="ufw enabled, no rule above the cluster's blocking its ports",
        reads=(probe.UFW,),
        judge=_ufw,
    ),
    Check(
        "interface",
        looks_at="the NCCL/gloo interface as launch resolves it: up, addressed, one MTU",
        reads=FACTS,
        judge=_on_facts(interfaces.evaluate),
        blocks_deepspeed=True,
    ),
    Check(
        "accelerators",
        looks_at="nvidia-smi and torch against the inventory",
        reads=FACTS,
        judge=_on_facts(nodes.accelerators),
    ),
    Check(
        "versions",
        looks_at="the training stack's versions, the same on every node",
        reads=FACTS,
        judge=_on_facts(nodes.versions),
        blocks_deepspeed=True,
    ),
    Check(
        "interconnect",
        looks_at="InfiniBand/RoCE devices and the NCCL_IB_DISABLE launch uses",
        reads=FACTS,
        judge=_on_facts(interconnect.interconnect),
    ),
    Check(
        "deepspeed_ops",
        looks_at="DeepSpeed's ops built ahead, no stale build lock",
        reads=FACTS,
        judge=_on_facts(extensions.evaluate),
        blocks_deepspeed=True,
    ),
    Check(
        "clock",
        looks_at="chronyd synchronised, each worker's offset from the head",
        # The workers' clients measure their offsets against the head's listener.
        reads=(probe.LISTENER, probe.CLIENT, probe.NODE_FACTS),
        judge=_clock,
    ),
    Check(
        "nfs",
        looks_at="the NFS server answering and every worker's mount of its export",
        reads=FACTS,
        judge=_on_facts(nfs.evaluate),
        blocks_deepspeed=True,
    ),
    Check(
        "shared_dir",
        looks_at="a file written by every node as the training uid, seen by the head",
        reads=(probe.NODE_FACTS, probe.SHARED_VERIFY),
        judge=_shared_dir,
        blocks_deepspeed=True,
    ),
    Check(
        "space",
        looks_at="/dev/shm and the shared dir's room for the run's checkpoints",
        reads=FACTS,
        judge=_space,
    ),
    Check(
        "data",
        looks_at="the data path's checksum, the same on every node",
        reads=FACTS,
        judge=_on_facts(storage.data),
    ),
    Check(
        "bandwidth",
        looks_at="iperf3 between nodes in O(log N) parallel rounds (every pair with --full-matrix)",
        reads=(probe.IPERF_TEST,),
        judge=_bandwidth,
        prints_own_lines=True,
    ),
    Check(
        "deepspeed", looks_at="a tiny DeepSpeed job writing a checkpoint to the shared dir, phase by phase"
    ),
)

BY_NAME = {check.name: check for check in REGISTRY}
#: Every check in run order; these names are what `--skip` takes.
CHECKS: tuple[str, ...] = tuple(BY_NAME)
#: The checks answered on the controller or by the probe playbook; the DeepSpeed job runs after them.
PROBE_CHECKS: tuple[str, ...] = tuple(name for name in CHECKS if name != "deepspeed")


def probes_for(names: list[str]) -> list[str]:
    """The probe playbook's tasks the checks `names` read: what the playbook runs (preflight_probes)."""
    return sorted({task for name in names for task in BY_NAME[name].reads})


def judge_all(found: Found, names: list[str]) -> list[Result]:
    """The probe checks among `names`, judged in run order; each one's lines printed as it is judged."""
    results: list[Result] = []
    for check in REGISTRY:
        if check.name in names and check.judge is not None:
            judged = check.judge(found)
            if not check.prints_own_lines:
                _print(judged)
            results += judged
    return results


def _print(results: list[Result]) -> None:
    for result in results:
        print(format_result(result), flush=True)


def deepspeed_blockers(report: Report) -> str:
    """Failures that make the DeepSpeed job pointless (it could only hang or fail on them)."""
    blocking = {check.name for check in REGISTRY if check.blocks_deepspeed}
    return ", ".join(sorted({f"{r.check} ({r.subject})" for r in report.failed if r.check in blocking}))


def add_skip_argument(parser: Any, flag: str, what: str) -> None:
    """`flag CHECK...`: preflight checks to leave out (repeatable), by CHECKS' names; `what` opens its
    help. `trainer preflight --skip` and `trainer up --preflight-skip`."""
    parser.add_argument(
        flag,
        nargs="+",
        action="extend",
        default=[],
        choices=CHECKS,
        metavar="CHECK",
        help=f"{what}: {', '.join(CHECKS)}",
    )
