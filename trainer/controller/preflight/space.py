"""Room for the job: the shared dir holds the checkpoints the run keeps, /dev/shm what the
processes of one node share.

A checkpoint's size is estimated from the job `trainer launch` would run (the plan):
- parameters: the bundled GPT's from its config (12·n_layer·n_embd² + n_embd·(2·256 + block_size),
  a 256-symbol vocabulary at most); a Hugging Face model's from its weight files on the head
  (bytes / bytes per parameter of its config's dtype); unknown for a hub id;
- bytes per parameter saved: 16 with DeepSpeed (fp32 master weights, two AdamW moments, the 16-bit
  model), 12 otherwise (fp32 weights and two moments); with LoRA 2% of the parameters train, so 2%
  of that;
- the shared dir needs (save_total_limit + 1) checkpoints: the ones kept and the one being written
  (save_total_limit 0 keeps all: every save_steps of max_steps).
/dev/shm: writable by the training user everywhere; on a node with several GPUs NCCL's shared-memory
transport needs SHM_PER_GPU_NODE (a container's 64 MB default fails); a one-node DeepSpeed job on
the CPU needs SHM_PER_DEEPSPEED_CPU_PROCESS per process (its shared-memory allreduce op).
"""

from __future__ import annotations

from typing import Any

from trainer.controller.inventory import Cluster
from trainer.controller.launcher.plan import JobPlan
from trainer.controller.preflight.host_facts import each_host_answer
from trainer.controller.preflight.report import FAIL, PASS, WARN, Result

CHECK = "space"
MIB = 1024**2
GIB = 1024**3
SHM_PER_GPU_NODE = 1 * GIB
#: deepspeed/ops/csrc/cpu/comm/shm.cpp: 2 × 1 MiB + 2 × 32 MiB per rank.
SHM_PER_DEEPSPEED_CPU_PROCESS = 66 * MIB
BUNDLED_VOCAB_MAX = 256
LORA_TRAINABLE = 0.02
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float64": 8}


def gib(size: float) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB / 10 else f"{size / MIB:.1f} MiB"


def parameters(plan: JobPlan, model: dict[str, Any] | None) -> tuple[int | None, str]:
    """(parameter count or None, where it came from)."""
    config = plan.config
    name = str(config["model"].get("name_or_path") or "")
    if not name:
        layers, width = int(config["model"]["n_layer"]), int(config["model"]["n_embd"])
        block = int(config["data"]["block_size"])
        return 12 * layers * width**2 + width * (2 * BUNDLED_VOCAB_MAX + block), "the bundled GPT's config"
    if not model or model.get("error") or not model.get("bytes"):
        why = (model or {}).get("error") or f"{name} is not a model directory on the head"
        return None, f"no weights to size ({why})"
    per_param = DTYPE_BYTES.get(str(model.get("dtype") or "bfloat16"), 2)
    return int(model["bytes"] // per_param), f"{gib(model['bytes'])} of weights in {name}"


def checkpoint_estimate(plan: JobPlan, model: dict[str, Any] | None) -> tuple[int | None, str]:
    count, source = parameters(plan, model)
    if count is None:
        return None, source
    per_param = 16 if plan.engine == "deepspeed" else 12
    size = count * per_param
    how = f"{count:,} parameters ({source}) × {per_param} bytes"
    if plan.config.get("lora", {}).get("enabled"):
        size = int(size * LORA_TRAINABLE)
        how += f" × {LORA_TRAINABLE:g} (LoRA)"
    return size, how


def checkpoints_kept(plan: JobPlan) -> int:
    limit = int(plan.config["checkpoint"]["save_total_limit"])
    if limit > 0:
        return limit + 1
    if plan.config["train"].get("max_steps") is None:
        # train.num_epochs: the steps are derived on the node from the data, unknown here; the
        # latest checkpoint at least is counted.
        return 1
    steps, every = int(plan.config["train"]["max_steps"]), int(plan.config["checkpoint"]["save_steps"])
    return (steps // every if every else 0) + 1


def shm_needed(cluster: Cluster, host, plan: JobPlan | None) -> tuple[int, str]:
    gpus = int(host.get("cluster_accelerators", 0) or 0)
    if gpus > 1:
        return SHM_PER_GPU_NODE, f"NCCL's shared-memory transport between {gpus} GPUs"
    engine = plan.engine if plan is not None else str(cluster.head.get("training_engine") or "")
    procs = plan.topology.gpus_per_node if plan is not None else int(host.get("training_procs_per_node") or 1)
    if cluster.is_single_host and engine == "deepspeed" and gpus == 0:
        return (
            procs * SHM_PER_DEEPSPEED_CPU_PROCESS,
            f"DeepSpeed's shared-memory allreduce for {procs} process(es)",
        )
    return 0, ""


def evaluate(cluster: Cluster, plan: JobPlan | None, facts: dict[str, Any], why_missing) -> list[Result]:
    head = cluster.head
    shared = str(head.get("cluster_shared_dir") or "?")
    model = (facts.get(head.name) or {}).get("model")
    estimate, how = checkpoint_estimate(plan, model) if plan else (None, "no plan (see the topology check)")
    kept = checkpoints_kept(plan) if plan else 1
    results = []
    for host, fact in each_host_answer(
        cluster.hosts,
        facts,
        why_missing,
        results,
        check=CHECK,
        unreadable=lambda host, why: f"could not look at free space on {host.name}: {why}",
        fix=lambda host: f"check that Ansible reaches {host.name} and python3 runs there",
    ):
        problems: list[tuple[str, str, str]] = []  # (status, detail, fix)
        shown: list[str] = []
        shm = fact.get("shm") or {}
        need, why = shm_needed(cluster, host, plan)
        if shm.get("error"):
            problems.append(
                (
                    FAIL,
                    f"the training user cannot use /dev/shm on {host.name}: {shm['error']}",
                    f"on {host.name}: /dev/shm must be a tmpfs with mode 1777 "
                    "(mount -o remount,mode=1777 /dev/shm)",
                )
            )
        elif shm.get("free_bytes", 0) < need:
            problems.append(
                (
                    FAIL,
                    f"/dev/shm on {host.name} has {gib(shm['free_bytes'])} free, {gib(need)} needed for "
                    f"{why}",
                    f"on {host.name}: mount -o remount,size={max(1, -(-need // GIB))}G /dev/shm "
                    "(a container: --shm-size), or free it (ls -la /dev/shm)",
                )
            )
        else:
            shown.append(f"/dev/shm {gib(shm.get('free_bytes', 0))} free")
        io = (fact.get("shared") or {}).get("io") or {}
        if io.get("hung") or io.get("error"):
            shown.append(f"{shared}: not measurable (see the nfs and shared_dir checks)")
        elif "free_bytes" in io:
            free = int(io["free_bytes"])
            shown.append(f"{shared} {gib(free)} free")
            if estimate is not None and host.name == head.name:
                needed = estimate * kept
                if free < estimate:
                    problems.append(
                        (
                            FAIL,
                            f"{shared} on {host.name} has {gib(free)} free, less than one checkpoint "
                            f"(about {gib(estimate)}: {how})",
                            f"free space in {shared} on {host.name} (old runs under {shared}/runs), or move "
                            "cluster_shared_dir to a larger disk",
                        )
                    )
                elif free < needed:
                    problems.append(
                        (
                            WARN,
                            f"{shared} on {host.name} has {gib(free)} free, {gib(needed)} needed for the "
                            f"{kept} checkpoint(s) a run keeps while writing the next "
                            f"(each about {gib(estimate)})",
                            f"free space in {shared} on {host.name}, or lower checkpoint.save_total_limit",
                        )
                    )
                else:
                    shown.append(f"needs about {gib(needed)} ({kept} × {gib(estimate)}: {how})")
        if any(p[0] == FAIL for p in problems) or any(p[0] == WARN for p in problems):
            worst = FAIL if any(p[0] == FAIL for p in problems) else WARN
            results.append(
                Result(
                    CHECK,
                    host.name,
                    worst,
                    "; ".join(p[1] for p in problems),
                    fix="; ".join(p[2] for p in problems),
                    data={"shm": shm, "shared_free": io.get("free_bytes"), "checkpoint_estimate": estimate},
                )
            )
        else:
            results.append(
                Result(
                    CHECK,
                    host.name,
                    PASS,
                    "; ".join(shown),
                    data={"shm": shm, "shared_free": io.get("free_bytes"), "checkpoint_estimate": estimate},
                )
            )
    return results
