"""Accelerators and software versions: the same on every node, and as the inventory says."""

from __future__ import annotations

from typing import Any

from trainer.controller.inventory import Cluster
from trainer.controller.preflight.compare import odd_ones
from trainer.controller.preflight.report import FAIL, PASS, Result

VERSION_KEYS = ("python", "torch", "deepspeed", "accelerate", "trainer")


def accelerators(cluster: Cluster, facts: dict[str, Any], why_missing) -> list[Result]:
    check = "accelerators"
    seen: dict[str, tuple[int, str]] = {}
    results: list[Result] = []
    for host in cluster.hosts:
        fact = (facts.get(host.name) or {}).get("accelerators")
        if fact is None or fact.get("error"):
            reason = fact["error"] if fact else why_missing(host.name)
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"cannot read accelerators: {reason}",
                    fix=f"check the NVIDIA driver on {host.name} (nvidia-smi)",
                )
            )
            continue
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
                    fix="use one GPU model per node (mixed types unbalance the ranks)",
                )
            )
        elif (count, model) != expected:
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"node reports {shown}; inventory says {expected[0]} x {expected[1]}",
                    fix=f"set cluster_accelerators: {count} and cluster_accelerator_model: {model!r} "
                    f"for {host.name} "
                    "in the inventory, or fix the node (driver, failed GPU)",
                    data={"count": count, "model": model},
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
                fix="every node needs the same number and model of accelerators "
                "(GPUS_PER_NODE is one number)",
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
    return [
        Result(
            check,
            host.name,
            FAIL,
            f"torch sees {visible} of the {expected} GPU(s) the inventory gives this node: {build}, "
            f"driver {driver}",
            fix="install the CUDA build of torch that matches the driver (training_torch_index_url_cuda, "
            "then ansible-playbook site.yml --tags trainer_env) or update the driver",
            data={"torch_gpus": visible, "torch_cuda": found.get("torch_cuda"), "driver": driver},
        )
    ]


def versions(cluster: Cluster, facts: dict[str, Any], why_missing) -> list[Result]:
    check = "versions"
    seen: dict[str, tuple[str | None, ...]] = {}
    results: list[Result] = []
    for host in cluster.hosts:
        found = (facts.get(host.name) or {}).get("versions")
        venv = host.get("training_venv", "?")
        if found is None or found.get("error"):
            reason = found["error"] if found else why_missing(host.name)
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"cannot read versions from {venv}: {reason}",
                    fix="create the training venv on this node: make provision",
                )
            )
            continue
        missing = [key for key in VERSION_KEYS if not found.get(key)]
        if missing:
            results.append(
                Result(
                    check,
                    host.name,
                    FAIL,
                    f"not installed in {venv}: {', '.join(missing)}",
                    fix="install the training stack into the venv: make provision",
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
