"""Hugging Face accelerate. On the CPU `Accelerator(cpu=True)` (it still runs multi-process under
torchrun or `accelerate launch --multi_gpu --num_processes N`; `--cpu` would start one process).
Checkpoints go through accelerate's save_state/load_state, with the LR scheduler registered."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from torch.nn.parallel import DistributedDataParallel

from trainer.node.engines import Batch, Engine
from trainer.node.engines.ddp import DDP_OPTIONS, sync_buffers_only_if_trained
from trainer.node.hf.lora import keep_adapter_inputs_in_compute_dtype
from trainer.node.optim import build_optimizer

STATE_DIR = "accelerate"


class AccelerateEngine(Engine):
    name = "accelerate"

    def __init__(self, train, topology, model: torch.nn.Module, bf16: bool = False):
        self.config = train
        self.topology = topology
        self.accelerator = Accelerator(
            cpu=not topology.device.startswith("cuda"),
            mixed_precision="bf16" if bf16 else "no",
            kwargs_handlers=[DistributedDataParallelKwargs(**DDP_OPTIONS)],
        )
        if bf16:  # prepare() wraps the forward in bf16 autocast
            keep_adapter_inputs_in_compute_dtype(model)
        optimizer, self.scheduler = build_optimizer(model, self.config)
        # The scheduler is not prepared: accelerate would step it once per process per step.
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        if isinstance(self.model, DistributedDataParallel):  # several processes
            sync_buffers_only_if_trained(self.model)
        self.accelerator.register_for_checkpointing(self.scheduler)
        self.module = self.accelerator.unwrap_model(self.model)
        # The trained parameters only: a LoRA base's frozen weights have no gradient to clip.
        self.trained = [p for p in self.module.parameters() if p.requires_grad]

    def train_step(self, micro_batches: Iterable[Batch]) -> torch.Tensor:
        accumulation = self.config.gradient_accumulation_steps
        total = torch.zeros((), device=self.topology.device)
        for index, batch in enumerate(micro_batches):
            sync = index == accumulation - 1
            with contextlib.nullcontext() if sync else self.accelerator.no_sync(self.model):
                loss = self.model(*batch)  # prepare() applied autocast when mixed precision is on
                self.accelerator.backward(loss / accumulation)
            total += loss.detach()  # on the device: read by the loop when it needs the number
        if self.config.grad_clip > 0:
            self.accelerator.clip_grad_norm_(self.trained, self.config.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total / accumulation

    def _forward(self, batch: Batch) -> torch.Tensor:
        return self.model(*batch)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def save(self, directory: Path) -> None:
        # Not safetensors: it drops the tied output head (shared with the embedding) and warns about it.
        self.accelerator.save_state(str(directory / STATE_DIR), safe_serialization=False)

    def load(self, directory: Path) -> None:
        self.accelerator.load_state(str(directory / STATE_DIR))
