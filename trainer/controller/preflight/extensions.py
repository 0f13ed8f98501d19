"""DeepSpeed's JIT ops on each node: built ahead by trainer_env, and no stale build lock.

A lock left by a build that was killed makes every later DeepSpeed start on that node wait forever
with no output (trainer.torch_extensions finds locks no process holds). Ops not built ahead are
compiled by the first DeepSpeed start: minutes on a busy node, silent meanwhile.
"""

from __future__ import annotations

from typing import Any

from trainer.controller.inventory import Cluster
from trainer.controller.preflight.host_facts import each_host_fact
from trainer.controller.preflight.report import FAIL, PASS, WARN, Result
from trainer.torch_extensions import stale_lock_fix

CHECK = "deepspeed_ops"
PROVISION = "ansible-playbook site.yml --tags trainer_env"


def evaluate(cluster: Cluster, facts: dict[str, Any], why_missing) -> list[Result]:
    user = str(cluster.head.get("cluster_training_user") or "the training user")
    results: list[Result] = []
    for host, found in each_host_fact(
        cluster,
        facts,
        "extensions",
        why_missing,
        results,
        check=CHECK,
        unreadable=lambda host, reason: f"cannot look at DeepSpeed's op builds on {host.name}: {reason}",
        fix=lambda host: f"reinstall the trainer in the venv on {host.name}: {PROVISION}",
    ):
        stale = found.get("stale") or []
        if stale:
            lock = stale[0]
            results.append(
                Result(
                    CHECK,
                    host.name,
                    FAIL,
                    f"stale build lock {lock['path']} (op {lock['op']}, {lock['age_s']:.0f} s old, no "
                    f"process holds it): every DeepSpeed start on {host.name} would wait on it forever, "
                    "silently" + (f" (and {len(stale) - 1} more)" if len(stale) > 1 else ""),
                    fix="; ".join(stale_lock_fix(one, host.name, user) for one in stale[:3]),
                    data={"stale": stale},
                )
            )
            continue
        built = found.get("built") or {}
        where = found.get("configured_dir") or found.get("default_dir")
        if built and all(built.values()):
            results.append(
                Result(
                    CHECK,
                    host.name,
                    PASS,
                    f"built ahead in {where}: {', '.join(sorted(built))}; no stale build lock",
                    data=found.get("manifest") or {},
                )
            )
        elif cluster.is_single_host:
            results.append(
                Result(
                    CHECK,
                    host.name,
                    PASS,
                    f"no stale build lock; the first DeepSpeed start builds its ops into {where} (once)",
                )
            )
        else:
            missing = sorted(name for name, ok in built.items() if not ok)
            results.append(
                Result(
                    CHECK,
                    host.name,
                    WARN,
                    f"DeepSpeed's ops are not built ahead on {host.name}"
                    + (f" ({', '.join(missing)} missing in {where})" if missing else "")
                    + ": the first DeepSpeed start compiles them, for minutes, with no output",
                    fix=f"{PROVISION} builds them into trainer_env_torch_extensions_dir on {host.name}",
                )
            )
    return results
