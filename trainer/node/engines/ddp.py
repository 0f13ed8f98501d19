"""torch DistributedDataParallel: gradients all-reduced once per optimizer step (no_sync before)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from trainer.node.engines import Batch, Engine, frozen_parameter_names, master_weights
from trainer.node.engines.master_weights import MasterWeights
from trainer.node.hf.lora import keep_adapter_inputs_in_compute_dtype
from trainer.node.optim import build_optimizer

STATE_FILE = "ddp_state.pt"


#: What the ddp and accelerate engines give DistributedDataParallel beyond its defaults.
#: gradient_as_bucket_view: the gradients live in DDP's all-reduce buckets instead of being copied out
#: of them after each all-reduce (the same values; one copy and one gradient's memory less).
DDP_OPTIONS = {"gradient_as_bucket_view": True}


def sync_buffers_only_if_trained(ddp: DistributedDataParallel) -> None:
    """DDP broadcasts every buffer from rank 0 before each forward by default: a collective per
    micro-batch. Only running statistics (batch norm) change in training; a decoder's buffers (rotary
    frequencies, causal masks) are constants, made equal on every rank when DDP wraps the model.
    (The attribute, not the constructor's argument: that one also skips the sync at wrapping.)"""
    ddp.broadcast_buffers = any(
        getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None
        for m in ddp.module.modules()
    )


class DDPEngine(Engine):
    name = "ddp"

    def __init__(self, train, topology, model: torch.nn.Module, bf16: bool = False):
        self.config = train
        self.topology = topology
        self.module = model.to(topology.device)
        device_type = torch.device(topology.device).type
        self.autocast = lambda: torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16)
        if bf16:
            keep_adapter_inputs_in_compute_dtype(self.module)
        device_ids = [topology.local_rank] if topology.device.startswith("cuda") else None
        self.model = DistributedDataParallel(self.module, device_ids=device_ids, **DDP_OPTIONS)
        sync_buffers_only_if_trained(self.model)
        # The trained parameters only: a LoRA base's frozen weights have no gradient to clip.
        self.trained = [p for p in self.module.parameters() if p.requires_grad]
        self.masters = MasterWeights(self.module) if wants_masters(self.trained, train.optimizer) else None
        self.optimizer, self.scheduler = build_optimizer(self.module, self.config, masters=self.masters)

    def train_step(self, micro_batches: Iterable[Batch]) -> torch.Tensor:
        accumulation = self.config.gradient_accumulation_steps
        total = torch.zeros((), device=self.topology.device)
        for index, batch in enumerate(micro_batches):
            # Only the last micro-batch all-reduces gradients; the others accumulate locally.
            sync = index == accumulation - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                with self.autocast():
                    loss = self.model(*batch)
                (loss / accumulation).backward()
            total += loss.detach()
        stepped = self.trained
        if self.masters is not None:
            self.masters.gradients_to_masters()
            stepped = self.masters.masters
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(stepped, self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        if self.masters is not None:
            self.masters.masters_to_model()
        self.module.zero_grad(set_to_none=True)
        return total / accumulation

    def _forward(self, batch: Batch) -> torch.Tensor:
        with self.autocast():
            return self.module(*batch)  # the bare module: no DDP hooks for a pass without gradients

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save(self, directory: Path) -> None:
        if self.topology.is_main:  # replicas are identical: one copy is the whole state
            frozen = frozen_parameter_names(self.module)
            state = {
                "model": {k: v for k, v in self._weights().items() if k not in frozen},
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
            torch.save(state, directory / STATE_FILE)

    def load(self, directory: Path) -> None:
        state = torch.load(directory / STATE_FILE, map_location=self.topology.device, weights_only=True)
        missing, unexpected = self.module.load_state_dict(state["model"], strict=False)
        if unexpected or set(missing) - frozen_parameter_names(self.module):
            raise RuntimeError(
                f"{directory / STATE_FILE} does not fit this model (missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]})"
            )
        if self.masters is not None:
            self.masters.load(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return self._weights() if self.topology.is_main else None

    def _weights(self) -> dict[str, torch.Tensor]:
        """The module's state dict, the fp32 masters in place of their bf16 weights where there are some."""
        state = self.module.state_dict()
        return state if self.masters is None else self.masters.state_dict(state)


def wants_masters(trained: list[torch.nn.Parameter], optimizer: str) -> bool:
    """fp32 master weights for the trained weights (master_weights.wanted), when all are of one dtype."""
    dtypes = {p.dtype for p in trained}
    return len(dtypes) == 1 and master_weights.wanted(dtypes.pop(), optimizer)
