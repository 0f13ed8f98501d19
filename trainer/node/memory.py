"""Will the model fit? Checked before the process group starts (check_fits: weights, gradients and
optimizer state against the node's memory, a lower bound), and an allocation that fails later named
as the same config error.

torch is imported inside functions: `trainer train` imports this module before it needs torch.
"""

from __future__ import annotations

from trainer.configerror import ConfigError
from trainer.node.checkpoint import human_size

#: What to try when a model does not fit (the end of the too-big error).
MEMORY_FIXES = (
    "use a smaller model (model.n_layer, model.n_embd, or a smaller model.name_or_path), train a LoRA "
    "adapter (lora.enabled=true, Hugging Face models), or shard it with DeepSpeed "
    "(distributed.engine=deepspeed, zero_stage=3, over more processes; offload_optimizer / offload_param "
    "to the CPU in a distributed.deepspeed_config)"
)


def training_bytes(
    *,
    parameters: int,
    trained: int,
    weight_bytes: float,
    engine: str,
    zero_stage: int,
    world_size: int,
) -> int:
    """Bytes one process holds for the weights, their gradients and AdamW's two moments: a lower bound
    (activations, buffers and the allocator's slack come on top). `trained` of the `parameters` get
    gradients and optimizer state; DeepSpeed keeps fp32 master weights and moments of 16-bit ones and
    shards the optimizer state (stage 1), the gradients (2) and the weights (3) over the processes."""
    frozen = parameters - trained
    if engine != "deepspeed":
        # The optimizer steps the parameters themselves: moments in their dtype.
        return int(frozen * weight_bytes + trained * 4 * weight_bytes)
    shards = max(1, world_size)
    optimizer = trained * (8 + (4 if weight_bytes < 4 else 0)) / shards
    gradients = trained * weight_bytes / (shards if zero_stage >= 2 else 1)
    weights = parameters * weight_bytes / (shards if zero_stage >= 3 else 1)
    return int(weights + gradients + optimizer)


def available_memory(device: str) -> tuple[int, str]:
    """Bytes a run on `device` may still allocate and where that number comes from. The CPU: the
    kernel's MemAvailable plus free swap (/proc/meminfo); a GPU: its free memory (cudaMemGetInfo)."""
    if device.startswith("cuda"):
        import torch

        index = torch.device(device).index or 0
        free, _ = torch.cuda.mem_get_info(index)
        return free, f"free on GPU {index}"
    fields = {}
    with open("/proc/meminfo") as handle:
        for line in handle:
            name, _, value = line.partition(":")
            fields[name] = int(value.split()[0]) * 1024
    if "MemAvailable" not in fields:
        raise OSError("/proc/meminfo has no MemAvailable")
    return fields["MemAvailable"] + fields.get("SwapFree", 0), "MemAvailable + SwapFree in /proc/meminfo"


def check_fits(
    *,
    parameters: int,
    trained: int,
    weight_bytes: float,
    engine: str,
    zero_stage: int,
    world_size: int,
    local_world_size: int,
    device: str,
) -> None:
    """ConfigError("model") when the weights, gradients and optimizer state alone exceed the memory the
    node has: a run that cannot start, refused before anything is created. Only the clearly impossible
    is refused (the estimate is a lower bound); a memory reading that fails refuses nothing."""
    try:
        available, source = available_memory(device)
    except (OSError, RuntimeError, ValueError):
        return
    per_process = training_bytes(
        parameters=parameters,
        trained=trained,
        weight_bytes=weight_bytes,
        engine=engine,
        zero_stage=zero_stage,
        world_size=world_size,
    )
    # The CPU's memory is shared by the node's processes; each GPU is one process's own.
    sharing = 1 if device.startswith("cuda") else max(1, local_world_size)
    needed = per_process * sharing
    if needed <= available:
        return
    processes = f" × {sharing} processes on this node" if sharing > 1 else ""
    trained_note = f" ({trained:,} trained)" if trained != parameters else ""
    raise ConfigError(
        "model",
        f"the model does not fit in memory: {parameters:,} parameters{trained_note} need at least "
        f"{human_size(needed)} for weights, gradients and optimizer state ({human_size(per_process)} per "
        f"process{processes}, {engine}), but {human_size(available)} is available ({source}); "
        f"{MEMORY_FIXES}",
    )


def is_out_of_memory(error: BaseException) -> bool:
    """An allocation that failed: CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's
    RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    import torch

    if isinstance(error, MemoryError | torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        marker in text for marker in ("can't allocate memory", "out of memory", "Cannot allocate memory")
    )


def out_of_memory_error(error: BaseException) -> ConfigError:
    """The too-big error for an allocation that failed while the model was built."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[-1][:300]
    return ConfigError(
        "model",
        f"the model does not fit in memory: allocating it failed ({type(error).__name__}: {first}); "
        f"{MEMORY_FIXES}",
    )
