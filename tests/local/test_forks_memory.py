"""The memory per node that trainer/controller/forks.py counts (BYTES_PER_NODE) against what following a
node really costs the controller: `trainer launch -- sleep` following 2 and then 8 simulated nodes
(scripts/testbed/netns_nodes.py), its processes' PSS summed over a window while it follows
(bench/scale.py's own measurement), the growth per added node compared with the figure.

Too low a figure lets the forks of a large job take more than the half of MemAvailable the limit
allows them; far too high (the sum of resident sets, which counts ansible-playbook's copy-on-write
pages again in every worker: about 60 MiB per node) refuses clusters the controller follows easily."""

from __future__ import annotations

import argparse

from helpers.simulated_nodes import NEEDS_NETNS, netns_nodes, scale

from trainer.controller import forks

MIB = 2**20


def _following_memory(cluster, tag: str) -> dict:
    args = argparse.Namespace(settle_s=3.0, follow_s=8.0, skip={"status", "stop"})
    result: dict = {}
    scale.measure_running_job(cluster, tag, args, result)  # ends with `trainer stop`, checked
    return result["follow"]


@NEEDS_NETNS
def test_the_memory_counted_per_node_covers_what_following_a_node_takes(sim_workdir):
    follow = {}
    for n in (2, 8):
        with netns_nodes.nodes(n, sim_workdir / f"sim{n}") as cluster:
            follow[n] = _following_memory(cluster, f"mem{n}")
    pss_per_node = (follow[8]["pss_mib"] - follow[2]["pss_mib"]) / 6
    rss_sum_per_node = (follow[8]["rss_sum_mib"] - follow[2]["rss_sum_mib"]) / 6
    counted = forks.BYTES_PER_NODE / MIB
    measured = (
        f"following 2 nodes: PSS {follow[2]['pss_mib']:.0f} MiB, 8 nodes: {follow[8]['pss_mib']:.0f} MiB "
        f"({pss_per_node:.1f} MiB per added node; RSS sum {rss_sum_per_node:.1f}); "
        f"forks.py counts {counted:.0f}"
    )
    assert pss_per_node <= counted, f"the limit counts too little per node: {measured}"
    assert pss_per_node >= counted / 2, f"the limit counts more than twice the cost per node: {measured}"
