"""A partial partition on three simulated nodes (scripts/testbed/netns_nodes.py: a network namespace,
an address and a real sshd each), issue 39: while the bundled trainer trains (ddp, one process per
node), n02's firewall (iptables in its own namespace) drops every TCP packet from its peers but SSH's,
so the collectives wait (every rank sleeps, state S: no process state tells the culprit) while the
launcher still reaches n02 over SSH. At the stall, each node's connects to its peers on the master
port (node_ctl.reach_peers) name n02 as the node no peer reaches: kind hung, exit 71, the stop's
history record names it, and every process of the launch is stopped."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
import yaml
from helpers.simulated_nodes import NEEDS_NETNS, netns_nodes
from helpers.testbed_nodes import LauncherOutput

from trainer import exitcodes

pytestmark = NEEDS_NETNS
CUT = 2
STALL_S = 20
SETS = (
    "train.max_steps=400",
    "train.warmup_steps=1",
    "train.log_every=1",
    "checkpoint.save_steps=1000",
    # gloo would end the wait with its own error after this: well past the stall and its stop.
    "distributed.timeout_s=600",
)


@pytest.fixture
def cluster(sim_workdir) -> Iterator:
    with netns_nodes.nodes(3, sim_workdir / "sim") as nodes:
        yield nodes


def firewall(namespace: str, *rule: str) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, "iptables", *rule], check=True, timeout=30)


def test_a_node_whose_firewall_drops_its_peers_while_ssh_works_is_named(cluster, tmp_path):
    inventory = tmp_path / "inventory"
    shutil.copytree(cluster.inventory, inventory)
    overrides = {"training_procs_per_node": 1, "training_engine": "ddp"}
    (inventory / "group_vars" / "cluster" / "zz_partition_test.yml").write_text(yaml.safe_dump(overrides))
    run_name = f"partition-{uuid.uuid4().hex[:6]}"
    sets = [arg for item in SETS for arg in ("--set", item)]
    launcher = LauncherOutput.start(
        [
            *(sys.executable, "-m", "trainer", "launch", "-i", str(inventory)),
            *("--run-name", run_name, "--stall-timeout", str(STALL_S), *sets),
        ]
    )
    cut, namespace = cluster.hosts[CUT], cluster.namespaces[CUT]
    try:
        assert launcher.wait_for(r"^step [3-9]/400", timeout=900) is not None, launcher.text()[-4000:]
        for peer, address in cluster.addresses.items():
            if peer != cut:  # the controller's SSH comes from its own address: it still works
                firewall(
                    namespace, "-A", "INPUT", "-s", address, "-p", "tcp", "!", "--dport", "22", "-j", "DROP"
                )
        cut_at = time.monotonic()
        code = launcher.finish(timeout=600)
        out = launcher.text()
    finally:
        if launcher.proc.poll() is None:
            launcher.finish(timeout=1)
        subprocess.run(["ip", "netns", "exec", namespace, "iptables", "-F", "INPUT"], check=False)
    took = time.monotonic() - cut_at

    def after(prefix: str) -> str:
        at = next((line.at - cut_at for line in launcher.lines if line.text.startswith(prefix)), None)
        return f"{at:.1f} s" if at is not None else "never"

    print(
        f"firewall rule on {cut}: stall detected {after('stalled (')}, culprit named {after('culprit: ')}, "
        f"reported (every node stopped) {after('hung: ')}, launcher ended {took:.1f} s after it"
    )
    assert code == exitcodes.HUNG, out
    named = re.search(rf"^culprit: {cut} does not answer its peers on port (\d+) while SSH works", out, re.M)
    assert named, out
    port = named.group(1)
    assert (
        f"hung: {cut} does not answer its peers on port {port} while SSH works (n00, n01 got no answer" in out
    )
    assert f"then: n00 (node 0): waiting in its collective: no answer from {cut} on port {port}" in out, out
    run = cluster.shared / "runs" / run_name
    history = [json.loads(line) for line in (run / "launch" / "history.jsonl").read_text().splitlines()]
    stop = [r for r in history if r.get("event") == "stopped"][-1]
    assert (stop["why"], stop["hosts"], stop["exit_code"]) == ("hung", [cut], exitcodes.HUNG), stop
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True)
    assert not [p for p in listed.stdout.split() if int(p) not in cluster.sshd_pids()], (
        "n02's trainer stopped"
    )
