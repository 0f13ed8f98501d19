"""Training engines behind one interface: `ddp`, `deepspeed`, `accelerate` (one small module each).

An engine owns the wrapped model, the optimizer and the scheduler; the loop (trainer.node.loop) only
calls `train_step`, `save`, `load`, `lr` and `parameter_checksum`, so the loop, checkpoints, metrics
and resume are the same for all three. The process group is started before the engine
(trainer.node.distributed); DeepSpeed and accelerate adopt it.

The engine modules import torch/deepspeed/accelerate at the top and are imported only by `create_engine`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from trainer.configerror import require
from trainer.engine_names import EngineName

if TYPE_CHECKING:
    import torch

    from trainer.node.distributed import Topology
    from trainer.node.schedule import TrainConfig

#: The model's forward arguments: (inputs, targets) for the built-in GPT; (input_ids, labels,
#: position_ids, num_items_in_batch) for a Hugging Face model (trainer.node.hf.batches).
Batch = tuple["torch.Tensor | None", ...]


@dataclass(kw_only=True)
class DistributedConfig:
    engine: EngineName = "ddp"
    """`ddp`: torch DistributedDataParallel; `deepspeed`: ZeRO (stage below); `accelerate`: HF accelerate."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage 1, 2 or 3 (deepspeed only). 2 is the multi-node choice; 3 needs a fast network."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend; auto = nccl with GPUs, gloo on the CPU."""
    timeout_s: int = 1800
    """How long a collective waits for the slowest rank before the run fails."""
    deepspeed_config: str = ""
    """Your own DeepSpeed JSON (deepspeed only), e.g. the Qwen guide's ds_config_zero2.json: offload,
    bucket sizes, overlap_comm as you write them; "auto" values take the trainer's (batch sizes,
    accumulation, clipping, bf16, zero stage); a value that disagrees with the trainer's is refused.
    '' = built from the keys above. What ran is written to OUTPUT_DIR/ds_config.json."""

    def __post_init__(self) -> None:
        require(
            not self.deepspeed_config or self.engine == "deepspeed",
            "deepspeed_config",
            f"applies to distributed.engine=deepspeed only (engine is {self.engine})",
        )
        require(self.zero_stage in (1, 2, 3), "zero_stage", f"must be 1, 2 or 3 (got {self.zero_stage})")
        require(self.timeout_s >= 10, "timeout_s", f"must be at least 10 seconds (got {self.timeout_s})")


class Engine:
    """The interface every engine implements. `module` is the bare model (for checksums, state)."""

    name = "base"
    module: torch.nn.Module
    topology: Topology

    def train_step(self, micro_batches: Iterable[Batch]) -> torch.Tensor:
        """Forward/backward over gradient_accumulation_steps micro-batches, clip, optimizer and
        scheduler step; returns this rank's mean loss over the micro-batches, a 0-dim tensor on the
        device: reading it (`float()`) waits for the step to finish on a GPU, so the loop reads it only
        when it needs the number (trainer.node.speedups: async_loss)."""
        raise NotImplementedError

    def lr(self) -> float:
        raise NotImplementedError

    def save(self, directory: Path) -> None:
        """Write model, optimizer and scheduler state into directory (called on every rank)."""
        raise NotImplementedError

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote (called on every rank)."""
        raise NotImplementedError

    def evaluate(self, batch: Batch) -> torch.Tensor:
        """The model's loss on batch without gradients, dropout off (call on every rank: ZeRO-3 gathers)."""
        import torch

        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                return self._forward(batch).detach()
        finally:
            self.module.train(was_training)

    def _forward(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Every weight of the model, complete, on rank 0 (None elsewhere); call on every rank."""
        return self.module.state_dict() if self.topology.is_main else None

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        """Parameters complete on this rank inside the block (ZeRO-3 gathers them)."""
        yield

    def parameter_checksum(self) -> str:
        """SHA-256 over this rank's parameters, bit for bit: equal on all ranks when they agree."""
        import torch

        digest = hashlib.sha256()
        with self.full_parameters():
            for name, param in sorted(self.module.named_parameters()):
                digest.update(name.encode())
                digest.update(param.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return digest.hexdigest()


def create_engine(
    train: TrainConfig,
    distributed: DistributedConfig,
    output_dir: Path,
    topology: Topology,
    model: torch.nn.Module,
    *,
    bf16: bool,
) -> Engine:
    """The engine `distributed.engine` names, wrapping model; DeepSpeed writes its JSON to output_dir."""
    engine = distributed.engine
    if not topology.device.startswith("cuda"):
        # Tell DeepSpeed (also imported by accelerate) it is on the CPU, instead of letting every rank
        # print a warning that it detected no GPU.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if engine == "ddp":
        from trainer.node.engines.ddp import DDPEngine

        return DDPEngine(train, topology, model, bf16=bf16)
    if engine == "deepspeed":
        from trainer.node.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(train, distributed, output_dir, topology, model, bf16=bf16)
    from trainer.node.engines.accelerate import AccelerateEngine

    return AccelerateEngine(train, topology, model, bf16=bf16)


def frozen_parameter_names(module: torch.nn.Module) -> set[str]:
    """Parameters the optimizer never changes (a LoRA base): checkpoints leave them out, since resuming
    loads them again from the model directory, unchanged."""
    # Every name: a tied output head shares the embedding's weight under a second name.
    return {
        name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad
    }
