"""InfiniBand/RoCE: which nodes list devices in /sys/class/infiniband, and what NCCL_IB_DISABLE the
launch will use (`cluster_nccl_ib_disable: auto` is 0 only when every node has devices)."""

from __future__ import annotations

from typing import Any

from trainer.controller.inventory import Cluster
from trainer.controller.preflight.host_facts import each_host_fact
from trainer.controller.preflight.report import FAIL, PASS, WARN, Result
from trainer.controller.training_env import IB_AUTO, IB_DEVICES_DIR, ib_disable_value

CHECK = "interconnect"


def interconnect(cluster: Cluster, facts: dict[str, Any], why_missing) -> list[Result]:
    results: list[Result] = []
    devices: dict[str, list[str]] = {}
    for host, found in each_host_fact(
        cluster,
        facts,
        "infiniband",
        why_missing,
        results,
        check=CHECK,
        unreadable=lambda _, reason: f"cannot read {IB_DEVICES_DIR}: {reason}",
        fix=lambda host: f"check that Ansible reaches {host.name} and python3 runs there",
    ):
        devices[host.name] = list(found)
        shown = (
            f"InfiniBand/RoCE devices: {', '.join(found)}"
            if found
            else "no InfiniBand/RoCE devices (Ethernet: NCCL uses TCP sockets)"
        )
        results.append(Result(CHECK, host.name, PASS, shown, data={"devices": list(found)}))
    if not devices:
        return results
    without = sorted(name for name, found in devices.items() if not found)
    setting = ib_disable_value(cluster.head.get("cluster_nccl_ib_disable"))
    if setting == IB_AUTO:
        if not without:
            results.append(
                Result(CHECK, "cluster", PASS, "NCCL_IB_DISABLE auto: 0 (InfiniBand/RoCE everywhere)")
            )
        elif len(without) == len(devices):
            results.append(
                Result(CHECK, "cluster", PASS, "NCCL_IB_DISABLE auto: 1 (no node has InfiniBand/RoCE)")
            )
        else:
            results.append(
                Result(
                    CHECK,
                    "cluster",
                    WARN,
                    f"NCCL_IB_DISABLE auto: 1 on every node, since {', '.join(without)} list no devices in "
                    f"{IB_DEVICES_DIR} (NCCL needs one transport for the whole job)",
                    fix=f"bring up the HCA on {', '.join(without)} (ibstat, the driver) or leave them out",
                )
            )
    elif setting == 0 and without:
        results.append(
            Result(
                CHECK,
                "cluster",
                FAIL,
                f"cluster_nccl_ib_disable is 0 but {', '.join(without)} list no devices in {IB_DEVICES_DIR}: "
                "NCCL cannot use InfiniBand/RoCE there",
                fix=f"set cluster_nccl_ib_disable: auto (or 1), or bring up the HCA on {', '.join(without)} "
                "(ibstat there)",
            )
        )
    elif setting == 1 and not without:
        results.append(
            Result(
                CHECK,
                "cluster",
                WARN,
                "every node has InfiniBand/RoCE but cluster_nccl_ib_disable is 1: NCCL uses TCP sockets",
                fix="set cluster_nccl_ib_disable: auto to use the interconnect",
            )
        )
    return results
