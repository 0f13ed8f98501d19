"""The `train` section of the trainer config: steps or epochs, batch sizes, the optimizer and its
learning-rate schedule, precision.

A leaf module (no other trainer module imported) so the loop, the engines, the optimizer and the
config loader can all use it without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from trainer.configerror import ConfigError, require

#: Optimizer steps when neither train.max_steps nor train.num_epochs is set (the tiny GPT's minute).
DEFAULT_MAX_STEPS = 80


@dataclass(kw_only=True)
class TrainConfig:
    max_steps: int | None = None
    """Optimizer steps to train for (a resumed run continues up to the same number). null: 80, unless
    train.num_epochs is set, which then decides. Set one of the two, not both."""
    num_epochs: float | None = None
    """Passes over the training data (1.5 is one and a half); null: train.max_steps decides. The steps
    are derived once the data is prepared on the node: num_epochs × the whole effective batches in the
    training rows × data.repeats (rounded up), shown in the log, the dry run and run.json."""
    micro_batch_size: int = 16
    """Samples per process per forward/backward pass."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; effective batch = micro_batch_size × world size × this."""
    seed: int = 1337
    """Seed for model init (same on all ranks), data order (same) and dropout (offset by rank)."""
    optimizer: Literal["adamw", "adamw_fused", "adamw_8bit"] = "adamw"
    """AdamW (betas 0.9, 0.99). `adamw`: torch's, its fused kernel where torch has one for the device
    (GPUs; the CPU in torch 2.4 and later), else its default implementation; `adamw_fused`: the fused
    kernel or a config error where there is none (the log says which); `adamw_8bit`:
    bitsandbytes' AdamW8bit, moments in 8 bits (a quarter of their memory): CUDA nodes with the
    `qlora` extra installed, ddp or accelerate engine (DeepSpeed shards the optimizer state itself)."""
    learning_rate: float = 3e-3
    """Peak learning rate, reached after the warmup."""
    lr_schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """After the warmup: `cosine` decays to the minimum along a half cosine, `linear` in a straight
    line, both reaching it at the last step; `constant` stays at learning_rate."""
    min_lr: float | None = None
    """Learning rate at the end of a cosine or linear decay; null: learning_rate × min_lr_ratio."""
    min_lr_ratio: float = 0.1
    """The minimum as a fraction of learning_rate, used when min_lr is null (so a learning_rate alone
    is a whole schedule)."""
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
    compile: bool | Literal["auto"] = "auto"
    """torch.compile the model: each decoder layer of a Hugging Face model (one compilation serves them
    all) and its output head with the loss, the whole built-in GPT. A slower start (6-20 s for a 0.4B
    Qwen2 on an H100 or H200; 3 s when its cache, under /tmp on the node, is warm), faster steps (there
    1.5-1.8x full or LoRA, 1.2-1.7x Q-LoRA). auto: on for a Hugging Face model on a GPU under ddp,
    accelerate or DeepSpeed ZeRO-1/2, without gradient checkpointing (where it was measured); off on
    the CPU (a minute of compiling), for the built-in GPT and elsewhere; true or false: as said."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass instead of keeping them (Hugging Face models only):
    much less memory for about a third more compute; what fits a 7B model's long samples on a GPU."""

    def __post_init__(self) -> None:
        if self.num_epochs is not None:
            require(
                self.max_steps is None,
                "num_epochs",
                f"and train.max_steps ({self.max_steps}) are both set; keep one: num_epochs derives the "
                "steps from the data, max_steps counts them",
            )
            require(
                math.isfinite(self.num_epochs) and self.num_epochs > 0,
                "num_epochs",
                f"must be greater than 0 (got {self.num_epochs})",
            )
        elif self.max_steps is None:
            self.max_steps = DEFAULT_MAX_STEPS
        for name in ("max_steps", "micro_batch_size", "gradient_accumulation_steps", "log_every"):
            value = getattr(self, name)
            require(value is None or value >= 1, name, f"must be at least 1 (got {value})")
        require(self.seed >= 0, "seed", f"must be 0 or more (got {self.seed})")
        require(self.learning_rate > 0, "learning_rate", f"must be greater than 0 (got {self.learning_rate})")
        require(
            self.min_lr is None or 0 <= self.min_lr <= self.learning_rate,
            "min_lr",
            f"must be between 0 and train.learning_rate={self.learning_rate} (got {self.min_lr}); "
            "or null for train.min_lr_ratio × learning_rate",
        )
        require(
            0.0 <= self.min_lr_ratio <= 1.0,
            "min_lr_ratio",
            f"must be in [0, 1]: a fraction of train.learning_rate (got {self.min_lr_ratio})",
        )
        require(self.warmup_steps >= 0, "warmup_steps", f"must be 0 or more (got {self.warmup_steps})")
        require(
            0.0 <= self.warmup_ratio < 1.0,
            "warmup_ratio",
            f"must be in [0, 1): a fraction of train.max_steps (got {self.warmup_ratio})",
        )
        require(self.weight_decay >= 0, "weight_decay", f"must be 0 or more (got {self.weight_decay})")
        require(self.grad_clip >= 0, "grad_clip", f"must be 0 (off) or more (got {self.grad_clip})")

    def steps(self) -> int:
        """max_steps, once known (with num_epochs: after derive_max_steps, on the node)."""
        if self.max_steps is None:
            raise ConfigError("num_epochs", "the steps are derived from the data on the node, not known yet")
        return self.max_steps

    def warmup(self) -> int:
        """Warmup steps in effect: warmup_ratio × max_steps (rounded up) when set, else warmup_steps."""
        if self.warmup_ratio > 0:
            return math.ceil(self.warmup_ratio * self.steps())
        return self.warmup_steps

    def floor_lr(self) -> float:
        """The learning rate a cosine or linear decay ends at."""
        return self.min_lr if self.min_lr is not None else self.learning_rate * self.min_lr_ratio

    def derive_max_steps(self, *, rows: int, repeats: int, world_size: int) -> str | None:
        """With num_epochs: set max_steps from the training rows (samples, or packed rows), the repeats
        and the effective batch, and return the log line that says how; None when max_steps was set.

        An epoch is one pass of the run's sample order (trainer.node.order): rows × repeats entries in
        whole steps of the effective batch, the remainder left out, so 1 epoch trains each row at most
        once per repeat."""
        if self.num_epochs is None:
            return None
        effective = self.micro_batch_size * world_size * self.gradient_accumulation_steps
        per_epoch = max(1, rows * repeats // effective)
        # 0.3 × 10 is 3.0000000000000004 in floats: three steps, not four.
        self.max_steps = max(1, math.ceil(self.num_epochs * per_epoch - 1e-9))
        left_out = rows * repeats % effective
        return (
            f"train.max_steps = {self.max_steps}: train.num_epochs {self.num_epochs:g} × {per_epoch} steps "
            f"per epoch ({rows} training rows × data.repeats {repeats} in steps of the effective batch "
            f"{effective} = micro_batch_size {self.micro_batch_size} × world size {world_size} × "
            f"gradient_accumulation_steps {self.gradient_accumulation_steps}"
            + (f"; the last {left_out} of each epoch's shuffled order are left out)" if left_out else ")")
        )

    def steps_record(self, *, rows: int, repeats: int, world_size: int) -> dict[str, float | int | str]:
        """What run.json records of max_steps: its value and what set it (with num_epochs, from what)."""
        if self.num_epochs is None:
            return {"max_steps": self.steps(), "set_by": "train.max_steps"}
        effective = self.micro_batch_size * world_size * self.gradient_accumulation_steps
        return {
            "max_steps": self.steps(),
            "set_by": "train.num_epochs",
            "num_epochs": self.num_epochs,
            "steps_per_epoch": max(1, rows * repeats // effective),
            "training_rows": rows,
            "repeats": repeats,
            "effective_batch": effective,
        }
