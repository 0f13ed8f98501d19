"""Preflight's SSH check at scale (issue 27) on simulated nodes: network namespaces, each with its own
real sshd (scripts/testbed/netns_nodes.py). A healthy cluster passes with no failure, each sshd gets a
handful of logins (counted in sshd's own log, far below MaxStartups' 10), the logins grow as N log N,
and real faults are named with their fixes."""

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
from helpers.simulated_nodes import NEEDS_NETNS, netns_nodes

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
