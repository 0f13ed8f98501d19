"""The job `trainer launch` would start, built the way launch builds it, on the controller in
milliseconds: node ranks (a duplicate `cluster_node_rank`, the head not rank 0), one process count
per node, world size, the master port, the trainer config with its batch arithmetic, training_env.

No rule is repeated here: `make_plan` (trainer.controller.launcher.plan, which calls
launcher.topology.build_topology) is what `trainer plan` and `trainer launch` run. This module turns
its verdict into a preflight result naming the hosts and the inventory variable to change.
"""

from __future__ import annotations

import re

from trainer.controller.inventory import Cluster, PlanningError
from trainer.controller.launcher.plan import JobPlan, make_plan
from trainer.controller.preflight.report import FAIL, PASS, Result

CHECK = "topology"


def _named_hosts(cluster: Cluster, text: str) -> list[str]:
    return [h.name for h in cluster.hosts if re.search(rf"(?<![\w.-]){re.escape(h.name)}(?![\w.-])", text)]


def evaluate(cluster: Cluster) -> tuple[list[Result], JobPlan | None]:
    """([result], the plan when it could be made)."""
    try:
        plan = make_plan(cluster)
    except PlanningError as err:
        message = str(err)
        hosts = _named_hosts(cluster, message)
        problem, _, remedy = message.rpartition("; ")
        remedy = remedy or f"fix the setting named above in {cluster.inventory}"
        return [
            Result(
                CHECK,
                ", ".join(hosts) or "cluster",
                FAIL,
                f"trainer launch would refuse this inventory: {problem or message}",
                fix=(f"for {', '.join(hosts)}: " if hosts else "")
                + f"{remedy}; then `trainer plan -i {cluster.inventory}` shows the job",
            )
        ], None
    topo = plan.topology
    ranks = ", ".join(
        f"{n.host} node {n.node_rank} (ranks {r.start}-{r.stop - 1})"
        if len(r := n.global_ranks(topo.gpus_per_node)) > 1
        else f"{n.host} node {n.node_rank} (rank {r.start})"
        for n in topo.nodes
    )
    batch = (
        f"; effective batch {plan.micro_batch_size} × {topo.world_size} × "
        f"{plan.gradient_accumulation_steps} = {plan.effective_batch_size}"
        if plan.runs_bundled_trainer
        else ""
    )
    return [
        Result(
            CHECK,
            "cluster",
            PASS,
            f"{topo.nnodes} node(s) × {topo.gpus_per_node} process(es), world size {topo.world_size}, "
            f"master {topo.master_addr}:{topo.master_port}, engine {plan.engine}{batch}; {ranks}",
            data=topo.as_dict(),
        )
    ], plan
