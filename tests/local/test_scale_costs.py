"""The controller's cost per node stays bounded (issue 27), on simulated nodes: network namespaces with
a real sshd each (scripts/testbed/netns_nodes.py), Ansible logging in as root and becoming the
training user, as on a real cluster. One run at N=2 and one at N=8, measured with bench/scale.py's
own instruments (a cgroup per command: ansible-playbook, its forks and the SSH masters that detach
from them), so the test and the benchmark count the same thing. Speed is asserted as ratios within
one run, never as seconds."""

from __future__ import annotations

import json
from typing import Any

from helpers.simulated_nodes import NEEDS_NETNS, netns_nodes, scale

#: The launch's cost per added node as a share of a whole 2-node launch's controller CPU, the fixed
#: part (interpreter, imports, inventory) being most of the latter. Measured with bench/scale.py on
#: this 2-core machine at load 25 to 45: main before issue 27 (e9128de) 0.81 CPU-s per node on 2.68,
#: a share of 0.30 (issue 27's own table: 0.45 on 2.6, 0.17); HEAD cb6bfd2 0.46 on 3.56, 0.13; the
#: goal, 0.1 CPU-s per node, is about 0.04. 0.2 leaves today's launch half again as much for a
#: loaded CI machine; it catches per-node work well above main's, but not a return to main's level
#: (this test passed once on e9128de: main's share varies from 0.17 to 0.30 with the load). Tighten
#: it to 0.1 once the launch meets its goal: then main's level fails it.
MAX_PER_NODE_SHARE = 0.2

pytestmark = NEEDS_NETNS


def launch_true(cluster: Any) -> Any:
    """`trainer launch -- true` on every node, measured; fails the test when it fails."""
    command = scale.Command(
        scale.trainer("launch", "-i", str(cluster.inventory), "--run-name", "scale-test", "--", "true"),
        cluster,
        f"ctsim-test-{cluster.slot}-launch",
    )
    measured = command.finish(timeout=300)
    assert measured.rc == 0, measured.output[-3000:]
    return measured


def test_launch_cost_per_node_and_no_ssh_master_left(sim_workdir):
    measured = {}
    for n in (2, 8):
        with netns_nodes.nodes(n, sim_workdir / f"sim{n}") as cluster:
            run = launch_true(cluster)
            # (a) The command ran on every node and each ended well.
            runs = cluster.shared / "runs" / "scale-test" / "launch"
            started = sorted(path.parent.name for path in runs.glob("node-*/pid"))
            assert started == [f"node-{i}" for i in range(n)], run.output[-3000:]
            # (b) Nothing of the launch still holds a connection to a node: no SSH master left.
            assert run.masters_left == 0, f"{run.masters_left} SSH master(s) of the launch still up"
            assert run.connections_left == 0, (
                f"after the launch returned, {run.connections_left} SSH connection(s) to the nodes were open"
            )
            measured[n] = run.controller_cpu_s
    per_node = (measured[8] - measured[2]) / 6
    assert per_node <= MAX_PER_NODE_SHARE * measured[2], (
        f"a launch costs the controller {per_node:.2f} CPU-s per added node, over "
        f"{MAX_PER_NODE_SHARE} of a whole 2-node launch ({measured[2]:.2f} CPU-s; 8 nodes: {measured[8]:.2f})"
    )


def test_preflight_ssh_check_passes_on_a_healthy_cluster(sim_workdir):
    from trainer.controller.preflight.checks import CHECKS

    report = sim_workdir / "preflight.json"
    others = [name for name in CHECKS if name not in ("topology", "ssh")]
    with netns_nodes.nodes(8, sim_workdir / "sim") as cluster:
        command = scale.Command(
            scale.trainer(
                "preflight", "-i", str(cluster.inventory), "--report", str(report), "--skip", *others
            ),
            cluster,
            f"ctsim-test-{cluster.slot}-preflight",
        )
        done = command.finish(timeout=300)
    results = [r for r in json.loads(report.read_text())["results"] if r["check"] == "ssh"]
    failed = [f"{r['subject']}: {r['detail']}" for r in results if r["status"] == "fail"]
    assert not failed, f"a healthy 8-node cluster failed SSH checks: {failed[:5]}\n{done.output[-2000:]}"
    checked = {host for r in results if r["status"] == "pass" for host in r["subject"].split(" -> ")}
    assert set(cluster.hosts) <= checked, f"SSH checked only between {sorted(checked)}"
