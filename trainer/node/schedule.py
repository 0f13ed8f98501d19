"""The `train` section of the trainer config: steps, batch sizes, the optimizer's schedule, precision.

A leaf module (no other trainer module imported) so the loop, the engines, the optimizer and the
config loader can all use it without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trainer.configerror import require


@dataclass(kw_only=True)
class TrainConfig:
    max_steps: int = 80
    """Optimizer steps to train for (a resumed run continues up to the same number)."""
    micro_batch_size: int = 16
    """Samples per process per forward/backward pass."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; effective batch = micro_batch_size × world size × this."""
    seed: int = 1337
    """Seed for model init (same on all ranks), data order (same) and dropout (offset by rank)."""
    learning_rate: float = 3e-3
    """Peak AdamW learning rate, reached after warmup_steps."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 10
    """Steps of linear warmup from near zero to learning_rate (unless warmup_ratio is set)."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of max_steps (the Qwen guide's 0.01); when above 0 it replaces warmup_steps."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices and embeddings (not on biases and norms)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""
    log_every: int = 10
    """Print a step line and write a metrics.jsonl record every this many steps (and at the first, last)."""
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"
    """bf16 autocast: auto = on GPUs that support bf16, off on the CPU; bf16 = always; no = never."""
    compile: bool = False
    """torch.compile the model (slower start, faster steps on GPUs)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (Hugging Face models only):
    much less memory for about a third more compute; what fits a 7B model's long samples on a GPU."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "micro_batch_size", "gradient_accumulation_steps", "log_every"):
            value = getattr(self, name)
            require(value >= 1, name, f"must be at least 1 (got {value})")
        require(self.seed >= 0, "seed", f"must be 0 or more (got {self.seed})")
        require(self.learning_rate > 0, "learning_rate", f"must be greater than 0 (got {self.learning_rate})")
        require(
            0 <= self.min_lr <= self.learning_rate,
            "min_lr",
            f"must be between 0 and train.learning_rate={self.learning_rate} (got {self.min_lr})",
        )
        require(self.warmup_steps >= 0, "warmup_steps", f"must be 0 or more (got {self.warmup_steps})")
        require(
            0.0 <= self.warmup_ratio < 1.0,
            "warmup_ratio",
            f"must be in [0, 1): a fraction of train.max_steps (got {self.warmup_ratio})",
        )
        require(self.weight_decay >= 0, "weight_decay", f"must be 0 or more (got {self.weight_decay})")
        require(self.grad_clip >= 0, "grad_clip", f"must be 0 (off) or more (got {self.grad_clip})")

    def warmup(self) -> int:
        """Warmup steps in effect: warmup_ratio × max_steps (rounded up) when set, else warmup_steps."""
        if self.warmup_ratio > 0:
            return math.ceil(self.warmup_ratio * self.max_steps)
        return self.warmup_steps
