"""The optimizer train.optimizer names, its parameter groups and the learning-rate schedule
(train.lr_schedule after a linear warmup): the same for every engine.

torch is imported inside the functions: `check_optimizer` runs before the process group starts, and
this module must not pull in the model (trainer.node.model imports the config, which imports the
engines, which import this module).
"""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING

from trainer.configerror import ConfigError
from trainer.node import speedups

if TYPE_CHECKING:
    import torch

    from trainer.node.engines.master_weights import MasterWeights
    from trainer.node.schedule import TrainConfig

#: nanoGPT's betas: a shorter memory of the squared gradients than torch's default 0.999.
BETAS = (0.9, 0.99)


def lr_multiplier(step: int, config: TrainConfig) -> float:
    """Factor on train.learning_rate for the given optimizer step (0-based, as LambdaLR counts)."""
    warmup = config.warmup()
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if config.lr_schedule == "constant":
        return 1.0
    span = max(1, config.steps() - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = config.floor_lr() / config.learning_rate
    if config.lr_schedule == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay matrices (weights, embeddings), not biases and norms (nanoGPT's rule)."""
    params = [p for p in model.parameters() if p.requires_grad]
    # Under ZeRO-3 a parameter is an empty partition; `ds_shape` is its real shape.
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    groups = [
        {"params": [p for p, m in zip(params, matrix, strict=True) if m], "weight_decay": weight_decay},
        {"params": [p for p, m in zip(params, matrix, strict=True) if not m], "weight_decay": 0.0},
    ]
    # An empty group (a LoRA adapter has no biases or norms) would be dropped by DeepSpeed, leaving the
    # LR schedule with one group too many.
    return [group for group in groups if group["params"]]


def check_optimizer(config: TrainConfig, *, device_type: str) -> str | None:
    """ConfigError("train.optimizer") when the named optimizer cannot run on this node (before the
    process group starts, on every rank); else the log line saying what runs, or None for plain adamw.
    device_type: "cuda" or "cpu", what the engine will train on."""
    if config.optimizer == "adamw_8bit":
        if device_type != "cuda":
            raise ConfigError(
                "train.optimizer",
                f"adamw_8bit runs on CUDA GPUs only (bitsandbytes' kernels) and this node trains on "
                f"{device_type}; use train.optimizer=adamw (or adamw_fused)",
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(
                "train.optimizer",
                "adamw_8bit needs bitsandbytes, which is not installed on this node; install the `qlora` "
                "extra (pip install 'clustertrain[qlora]') in the training venv, or use "
                "train.optimizer=adamw",
            )
        return "optimizer: AdamW with 8-bit state (bitsandbytes AdamW8bit)"
    if config.optimizer == "adamw_fused":
        try:  # torch's own list (private); without it, AdamW(fused=True) says so when it is built
            from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as fused_devices
        except ImportError:
            fused_devices = None
        if fused_devices is not None and device_type not in fused_devices():
            raise ConfigError(
                "train.optimizer",
                f"adamw_fused: torch {_torch_version()} has no fused AdamW kernel for {device_type}; "
                "use train.optimizer=adamw",
            )
        where = "torch's CUDA kernel" if device_type == "cuda" else "torch's CPU kernel, no GPU involved"
        return f"optimizer: AdamW, fused ({where})"
    return None


def fused_kernel_for(groups: list[dict]) -> bool:
    """torch has a fused AdamW kernel for every parameter's device and dtype (all on one device type)."""
    import torch

    try:  # torch's own list (private); without it, the default implementation
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices as fused_devices
    except ImportError:
        return False
    params = [p for group in groups for p in group["params"]]
    kinds = {p.device.type for p in params}
    floats = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    return len(kinds) == 1 and kinds <= set(fused_devices()) and all(p.dtype in floats for p in params)


def _torch_version() -> str:
    import torch

    return torch.__version__


def build_optimizer(
    model: torch.nn.Module, config: TrainConfig, *, masters: MasterWeights | None = None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """masters: the optimizer steps these fp32 copies of the model's trained weights instead."""
    import functools

    import torch

    groups = parameter_groups(model, config.weight_decay)
    if masters is not None:
        groups = masters.groups(groups)
    if config.optimizer == "adamw_8bit":
        import bitsandbytes

        optimizer = bitsandbytes.optim.AdamW8bit(groups, lr=config.learning_rate, betas=BETAS)
    else:
        fused = config.optimizer == "adamw_fused" or (
            config.optimizer == "adamw" and speedups.enabled("fused_adamw") and fused_kernel_for(groups)
        )
        optimizer = torch.optim.AdamW(groups, lr=config.learning_rate, betas=BETAS, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_multiplier, config=config))
    return optimizer, scheduler
