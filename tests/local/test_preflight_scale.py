"""Preflight at scale (issue 27) on simulated nodes: network namespaces, each with its own real sshd
(scripts/testbed/netns_nodes.py). A healthy cluster passes the SSH check with no failure, each sshd
gets a handful of logins (counted in sshd's own log, far below MaxStartups' 10), the logins grow as
N log N, and real faults are named with their fixes; one slow link is named after its second, longer
measurement; the fast pass's cost per added node stays a bounded share of a 2-node run's."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.simulated_nodes import NEEDS_NETNS, netns_nodes, scale

from trainer import exitcodes

REPO = Path(__file__).resolve().parents[2]
#: Every check but ssh (topology runs on the controller): the nodes have no chrony, NFS or ufw.
OTHERS = ("master_port", "ufw", "interface", "accelerators", "versions", "interconnect", "deepspeed_ops",
          "clock", "nfs", "shared_dir", "space", "data", "bandwidth", "deepspeed")  # fmt: skip


netns = netns_nodes
pytestmark = [pytest.mark.slow, NEEDS_NETNS]


def preflight_ssh(cluster, report: Path) -> tuple[subprocess.CompletedProcess, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "preflight", "-i", str(cluster.inventory), "--report", str(report),
         "--skip", *OTHERS],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return out, json.loads(report.read_text())


def accepted_logins(cluster) -> dict[str, int]:
    """Per node, the training user's logins its sshd accepted, from sshd's own log."""
    counts = {}
    for i, name in enumerate(cluster.hosts):
        log = (cluster.root / "nodes" / str(i) / "sshd.log").read_text()
        counts[name] = len(re.findall(rf"Accepted publickey for {cluster.user} from", log))
        assert "MaxStartups" not in log and "drop connection" not in log, log[-2000:]
    return counts


def test_a_healthy_cluster_passes_with_n_log_n_logins_and_few_per_sshd(tmp_path, sim_workdir):
    logins = {}
    for count in (4, 8):
        with netns.nodes(count, sim_workdir / f"sim{count}") as cluster:
            out, report = preflight_ssh(cluster, tmp_path / f"report{count}.json")
            assert out.returncode == exitcodes.OK, out.stdout + out.stderr
            ssh = [r for r in report["results"] if r["check"] == "ssh"]
            assert ssh and all(r["status"] == "pass" for r in ssh), ssh
            # Every ordered pair is proven: logged in to, or its keys read from both ends.
            proven = {tuple(r["subject"].split(" -> ")) for r in ssh if not r["subject"].endswith("*")}
            proven |= {(r["subject"].split(" -> ")[0], p) for r in ssh if r["subject"].endswith("*")
                       for p in r["data"]["peers"]}  # fmt: skip
            assert proven == {(a, b) for a in cluster.hosts for b in cluster.hosts if a != b}
            # Each sshd received ceil(log2 N) logins in all, one per round: by sshd's own log.
            received = accepted_logins(cluster)
            rounds = math.ceil(math.log2(count))
            assert set(received.values()) == {rounds}, received
            assert report["ssh"]["logins"] == sum(received.values())
            assert report["ssh"]["max_concurrent_logins_per_sshd"] <= rounds < 10
            logins[count] = report["ssh"]["logins"]
    # N log N, not N(N-1): 8 and 24 logins (12 and 56 for every pair).
    assert logins == {4: 8, 8: 24}
    assert logins[8] / logins[4] < (8 * 7) / (4 * 3)


def test_a_refused_key_and_a_stopped_sshd_are_named_with_their_fixes(tmp_path, sim_workdir):
    with netns.nodes(8, sim_workdir / "sim") as cluster:
        # n03's sshd no longer takes the training user's key (its own AuthorizedKeysFile, empty);
        # root's (Ansible's) still works. n05's sshd is stopped.
        empty = cluster.root / "empty_keys"
        empty.write_text("")
        config = cluster.root / "nodes" / "3" / "sshd_config"
        config.write_text(config.read_text() + f"Match User {cluster.user}\n    AuthorizedKeysFile {empty}\n")
        pids = cluster.sshd_pids()
        os.kill(pids[3], signal.SIGHUP)  # sshd re-reads its config
        os.kill(pids[5], signal.SIGTERM)
        out, report = preflight_ssh(cluster, tmp_path / "report.json")
    assert out.returncode == exitcodes.PREFLIGHT_FAILED, out.stdout + out.stderr
    failed = {r["subject"]: r for r in report["results"] if r["check"] == "ssh" and r["status"] == "fail"}
    into_n03 = {f"{n} -> n03" for n in cluster.hosts if n not in ("n03", "n05")}
    into_n05 = {"n04 -> n05", "n03 -> n05", "n01 -> n05"}  # the sources that log in to n05 (i-1, i-2, i-4)
    assert set(failed) == into_n03 | into_n05 | {"n05 -> *"}, sorted(failed)
    for subject in into_n03:  # logged in to or judged by the keys: the same cause and fix
        assert "authorized_keys on n03" in failed[subject]["fix"], failed[subject]
    for subject in into_n05:
        assert "nothing listens for SSH on n05" in failed[subject]["detail"]
        assert "start sshd on n05" in failed[subject]["fix"], failed[subject]
    assert "Ansible cannot reach n05" in failed["n05 -> *"]["detail"]


#: Every check but bandwidth (topology runs on the controller).
NOT_BANDWIDTH = tuple(name for name in ("ssh", *OTHERS) if name != "bandwidth")


def test_a_link_dropped_one_way_and_a_changed_host_key_fail_only_their_pair_and_node(tmp_path, sim_workdir):
    """Two faults at once on 4 nodes, every pair measured. n02's firewall drops new connections from
    n00 to the comm port range (SSH still open, replies let through, as ufw's `deny` would): the reach
    pass before the iperf3 rounds finds it in seconds and names the direction, and no one-off server
    waits out a client that can never reach it (before: "unable to connect", a server waiting 106 s,
    121 s of probe pass against 15 s healthy on this machine). n03's sshd answers with another host
    key: n03 is named for it, and its pairs are not blamed on a firewall. Every other pair passes."""
    with netns.nodes(4, sim_workdir / "sim") as cluster:
        head, n02 = cluster.addresses["n00"], cluster.namespaces[2]
        subprocess.run(["ip", "netns", "exec", n02, "iptables", "-I", "INPUT", "-p", "tcp", "-s", head,
                        "--dport", "1024:65535", "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP"],
                       check=True)  # fmt: skip
        other_key = cluster.root / "another_host_key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other_key)], check=True)
        config = cluster.root / "nodes" / "3" / "sshd_config"
        config.write_text(re.sub(r"(?m)^HostKey .*$", f"HostKey {other_key}", config.read_text()))
        os.kill(cluster.sshd_pids()[3], signal.SIGHUP)  # sshd re-reads its config
        report_path = tmp_path / "report.json"
        out = subprocess.run(
            [sys.executable, "-m", "trainer", "preflight", "-i", str(cluster.inventory), "--report",
             str(report_path), "--full-matrix",
             "--skip", *(n for n in OTHERS if n not in ("master_port", "bandwidth"))],
            cwd=REPO, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    assert out.returncode == exitcodes.PREFLIGHT_FAILED, out.stdout + out.stderr
    report = json.loads(report_path.read_text())
    failed = {(r["check"], r["subject"]): r for r in report["results"] if r["status"] not in ("pass", "skip")}
    blocked = failed.pop(("bandwidth", "n00 <-> n02"))
    assert "n00 cannot open a connection to n02" in blocked["detail"], blocked
    assert "(dropped)" in blocked["detail"] and "iptables -S INPUT" in blocked["fix"], blocked
    assert failed and all("n03" in subject for _, subject in failed), sorted(failed)
    for (check, _), result in failed.items():
        if check == "bandwidth":
            assert "Ansible cannot reach n03" in result["detail"] and "firewall" not in result["fix"], result
    assert any("n03's host key" in r["detail"] for (check, _), r in failed.items() if check == "ssh"), failed
    print(f"one link dropped one way, one host key changed: probe pass {report['probe_duration_s']:.1f} s")


def test_one_slow_link_is_named_after_a_second_longer_measurement(tmp_path, sim_workdir):
    """n05's egress shaped to 50 Mbit/s: every sampled pair with n05 is slow from n05, measured again
    (longer, on those hosts only) and still slow, and named with the direction and its fix; no other
    pair warns, even where a short test on this busy machine came out slow once."""
    with netns.nodes(8, sim_workdir / "sim") as cluster:
        shaped = cluster.namespaces[5]
        subprocess.run(["ip", "netns", "exec", shaped, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
                        "rate", "50mbit", "burst", "32kbit", "latency", "400ms"], check=True)  # fmt: skip
        report_path = tmp_path / "report.json"
        out = subprocess.run(
            [sys.executable, "-m", "trainer", "preflight", "-i", str(cluster.inventory), "--report",
             str(report_path), "--skip", *NOT_BANDWIDTH],
            cwd=REPO, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    assert out.returncode == exitcodes.OK, out.stdout + out.stderr  # a slow link warns, it does not fail
    report = json.loads(report_path.read_text())
    with_n05 = {frozenset(pair) for rnd in report["bandwidth"]["rounds"] for pair in rnd if "n05" in pair}
    assert len(with_n05) == 4, report["bandwidth"]["rounds"]  # the 4 sampled rounds at 8 nodes
    bandwidth = [r for r in report["results"] if r["check"] == "bandwidth"]
    warned = {frozenset(r["subject"].split(" <-> ")): r for r in bandwidth if r["status"] != "pass"}
    assert set(warned) == with_n05, out.stdout
    for result in warned.values():
        assert result["status"] == "warn", result
        assert "n05 -> " in result["detail"] and "below the median of the other links" in result["detail"]
        assert "(measured twice: the faster of the two)" in result["detail"], result
        assert "tc qdisc show" in result["fix"] and "n05" in result["fix"], result
    assert with_n05 <= {frozenset(pair) for pair in report["bandwidth"]["retested"]}
    assert "(3 s each): far below the other links" in out.stdout, out.stdout


#: preflight's fast pass, the controller's CPU per added node as a share of a whole 2-node run's (whose
#: fixed part, interpreter, imports, inventory and the playbook's start, is most of it). Measured with
#: bench/scale.py at N = 2 and 8 on this 2-core machine (load 5 to 15), before and after alternately:
#: eda139f 4.29 and 17.38 CPU-s, 2.18 per added node, a share of 0.51 (0.26 in a quieter run); after
#: (1 s iperf3 tests, no set_fact or iperf3 stop task, ufw read in the first task as root, the head's
#: tasks in plays of their own) 4.18 and 9.10, 0.82 per node, 0.20. The rounds as a task each plus a
#: stop task (cb6bfd2) were about 0.5, N(N-1) logins (e9128de) 0.8. 0.4 leaves today's pass twice its
#: share for a loaded CI machine and fails a return to either.
MAX_PER_NODE_SHARE = 0.4


def preflight_fast_pass(cluster, report: Path):
    """`trainer preflight --skip deepspeed` measured by bench/scale.py's instruments."""
    command = scale.Command(
        scale.trainer(
            "preflight", "-i", str(cluster.inventory), "--report", str(report), "--skip", "deepspeed"
        ),
        cluster,
        f"ctsim-test-{cluster.slot}-preflight",
    )
    return command.finish(timeout=600)


#: The simulated nodes have no chrony, NFS or ufw: those checks fail there; nothing else may.
EXPECTED = {"clock", "nfs", "ufw"}


def test_the_fast_pass_costs_the_controller_a_bounded_share_per_node(tmp_path, sim_workdir):
    measured = {}
    for count in (2, 8):
        with netns.nodes(count, sim_workdir / f"sim{count}") as cluster:
            run = preflight_fast_pass(cluster, tmp_path / f"report{count}.json")
        report = json.loads((tmp_path / f"report{count}.json").read_text())
        failed = {r["check"] for r in report["results"] if r["status"] == "fail"}
        unexpected = [r for r in report["results"] if r["status"] == "fail" and r["check"] not in EXPECTED]
        assert failed <= EXPECTED, json.dumps(unexpected, indent=1)[-3000:]
        measured[count] = run.controller_cpu_s
    per_node = (measured[8] - measured[2]) / 6
    assert per_node <= MAX_PER_NODE_SHARE * measured[2], (
        f"preflight's fast pass costs the controller {per_node:.2f} CPU-s per added node, over "
        f"{MAX_PER_NODE_SHARE} of a whole 2-node run ({measured[2]:.2f} CPU-s; 8 nodes: {measured[8]:.2f})"
    )
