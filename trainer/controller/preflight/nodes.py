"""Accelerators and software versions: the same on every node, and as the inventory says."""

from __future__ import annotations

from typing import Any

from trainer.controller.inventory import Cluster, Host
from trainer.controller.preflight.compare import odd_ones
from trainer.controller.preflight.host_facts import each_host_fact
from trainer.controller.preflight.report import FAIL, PASS, Result

VERSION_KEYS = ("python", "torch", "deepspeed", "accelerate", "trainer")


def accelerators(cluster: Cluster, facts: dict[str, Any], why_missing) -> list[Result]:
    check = "accelerators"
    seen: dict[str, tuple[int, str]] = {}
    results: list[Result] = []
    for host, fact in each_host_fact(
        cluster,
        facts,
        "accelerators",
        why_missing,
        results,
        check=check,
        unreadable=lambda _, reason: f"cannot read accelerators: {reason}",
        fix=lambda host: (
            f"on {host.name}: nvidia-smi must list the GPUs (install or repair the NVIDIA "
            "driver), or set cluster_accelerators: 0 for a CPU node"
        ),
    ):
        count = int(fact["count"])
        models = sorted(set(fact["models"]))
        model = models[0] if len(models) == 1 else ("cpu" if not models else " + ".join(models))
        seen[host.name] = (count, model)
        expected = (
            int(host.get("cluster_accelerators", 0) or 0),
            str(host.get("cluster_accelerator_model", "cpu")),
        )
        shown = f"{count} x {model}" if count else "no GPU (cpu)"
        if len(models) > 1:
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"mixed GPU models on one node: {', '.join(models)}",
                    fix=f"give {host.name} one GPU model (mixed types unbalance the ranks), or leave it out "
                    "of the inventory",
                )
            )
        elif (count, model) != expected:
            torch_count = ((facts.get(host.name) or {}).get("versions") or {}).get("torch_gpus")
            torch_says = (
                f"; torch in the venv sees {torch_count}, as nvidia-smi does: the inventory disagrees"
                if torch_count == count and expected[0] > 0
                else (
                    f"; torch in the venv sees {torch_count}"
                    if torch_count is not None and expected[0] > 0
                    else ""
                )
            )
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"nvidia-smi lists {shown}; inventory says {expected[0]} x {expected[1]}{torch_says}",
                    fix=f"set cluster_accelerators: {count} and cluster_accelerator_model: {model!r} "
                    f"for {host.name} "
                    "in the inventory, or fix the node (driver, failed GPU: nvidia-smi -q)",
                    data={"count": count, "model": model, "torch_gpus": torch_count},
                )
            )
        else:
            results.append(Result(check, host.name, PASS, shown, data={"count": count, "model": model}))
        results += torch_sees_the_gpus(
            host, expected[0], fact, (facts.get(host.name) or {}).get("versions") or {}
        )
    reference, odd = odd_ones(seen, cluster.head.name)
    for name in odd:
        count, model = seen[name]
        results.append(
            Result(
                check,
                name,
                FAIL,
                f"{count} x {model} differs from the other nodes ({reference[0]} x {reference[1]})",
                fix=f"give {name} the same GPUs as the other nodes (nvidia-smi -L on {name} lists what it "
                "sees: a failed GPU?), or leave it out of the inventory (GPUS_PER_NODE is one number)",
            )
        )
    return results


def torch_sees_the_gpus(host, expected: int, smi: dict[str, Any], found: dict[str, Any]) -> list[Result]:
    """The inventory gives the node GPUs: does the training venv's torch see them? (nvidia-smi can
    list every GPU while a CPU build of torch, or a driver older than its CUDA, sees none.)"""
    if expected <= 0 or found.get("error") or not ("torch_gpus" in found or "torch_error" in found):
        return []  # a CPU node; or no venv or no torch facts, which the versions check reports
    check = "accelerators"
    driver = smi.get("driver") or smi.get("source", "no driver")
    if found.get("torch_error"):
        return [
            Result(
                check,
                host.name,
                FAIL,
                f"torch does not import in {host.get('training_venv', '?')}: {found['torch_error']}",
                fix=f"reinstall the venv on {host.name}: ansible-playbook site.yml --tags trainer_env",
            )
        ]
    visible = int(found.get("torch_gpus") or 0)
    cuda = found.get("torch_cuda")
    build = f"torch {found.get('torch')} ({f'CUDA {cuda} build' if cuda else 'CPU build'})"
    if visible >= expected:
        return [Result(check, host.name, PASS, f"torch sees {visible} GPU(s): {build}, driver {driver}")]
    listed = smi.get("count")
    # Which source disagrees: nvidia-smi (the driver's view) or torch (what training will use).
    verdict = (
        "torch disagrees with nvidia-smi and the inventory"
        if listed is not None and int(listed) >= expected
        else f"nvidia-smi lists {listed} too: the node lacks GPUs, not only torch"
    )
    return [
        Result(
            check,
            host.name,
            FAIL,
            f"torch sees {visible} of the {expected} GPU(s) the inventory gives this node "
            f"(nvidia-smi lists {listed}): {verdict}; {build}, driver {driver}",
            fix=f"install on {host.name} the CUDA build of torch that matches its driver "
            "(training_torch_index_url_cuda, then ansible-playbook site.yml --tags trainer_env) or update "
            f"the driver on {host.name}",
            data={"torch_gpus": visible, "torch_cuda": found.get("torch_cuda"), "driver": driver},
        )
    ]


PROVISION_ENV = "ansible-playbook site.yml --tags trainer_env"


def _venv(host: Host) -> str:
    return str(host.get("training_venv", "?"))


def versions(cluster: Cluster, facts: dict[str, Any], why_missing) -> list[Result]:
    check = "versions"
    seen: dict[str, tuple[str | None, ...]] = {}
    results: list[Result] = []
    for host, found in each_host_fact(
        cluster,
        facts,
        "versions",
        why_missing,
        results,
        check=check,
        unreadable=lambda host, reason: f"cannot read versions from {_venv(host)}: {reason}",
        fix=lambda host: (
            f"create the training venv on {host.name}: ansible-playbook site.yml --tags trainer_env"
        ),
    ):
        venv = _venv(host)
        missing = [key for key in VERSION_KEYS if not found.get(key)]
        if missing:
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"not installed in {venv}: {', '.join(missing)}",
                    fix=f"install the training stack into the venv on {host.name}: "
                    "ansible-playbook site.yml --tags trainer_env",
                )
            )
        seen[host.name] = tuple(found.get(key) for key in VERSION_KEYS)
    reference, odd = odd_ones(seen, cluster.head.name)
    for name, values in seen.items():
        shown = ", ".join(f"{k} {v}" for k, v in zip(VERSION_KEYS, values, strict=True))
        if name in odd:
            diffs = ", ".join(
                f"{k} {v} (others {r})"
                for k, v, r in zip(VERSION_KEYS, values, reference, strict=True)
                if v != r
            )
            results.append(
                Result(
                    check,
                    name,
                    FAIL,
                    f"differs: {diffs}",
                    fix=f"install the same versions on {name} as on the other nodes "
                    "(one pinned requirements set or wheelhouse: make provision)",
                    data=dict(zip(VERSION_KEYS, values, strict=True)),
                )
            )
        elif all(values):
            results.append(
                Result(check, name, PASS, shown, data=dict(zip(VERSION_KEYS, values, strict=True)))
            )
    return results
