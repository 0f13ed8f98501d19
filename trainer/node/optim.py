"""AdamW with a linear-warmup, cosine-decay learning rate: the same for every engine."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from trainer.node.schedule import TrainConfig


def lr_multiplier(step: int, config: TrainConfig) -> float:
    """Factor on train.learning_rate for the given optimizer step (0-based, as LambdaLR counts)."""
    warmup = config.warmup()
    if step < warmup:
        return (step + 1) / (warmup + 1)
    span = max(1, config.max_steps - warmup)
    progress = min(1.0, (step - warmup) / span)
    floor = config.min_lr / config.learning_rate
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: torch.nn.Module, config: TrainConfig
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    import functools

    import torch

    from trainer.node.model import parameter_groups

    optimizer = torch.optim.AdamW(
        parameter_groups(model, config.weight_decay), lr=config.learning_rate, betas=(0.9, 0.99)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(lr_multiplier, config=config))
    return optimizer, scheduler
