"""DeepSpeed ZeRO 1/2/3. The DeepSpeed JSON is generated from the trainer config and written to
OUTPUT_DIR/ds_config.json, so the user sees (and can reuse) exactly what ran. Checkpoints go through
DeepSpeed's own save_checkpoint/load_checkpoint (each rank writes its optimizer shard); one written by
another number of processes is loaded through DeepSpeed's universal checkpoint (ds_universal)."""

from __future__ import annotations

import contextlib
import json
import logging
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import deepspeed
import torch

from trainer.node.engines import Batch, Engine, ds_universal, frozen_parameter_names
from trainer.node.engines.ds_json import deepspeed_config  # trainer.ds_config's, for the node's objects
from trainer.node.optim import build_optimizer

CHECKPOINT_TAG = "deepspeed"


def adopt_process_group(backend: str) -> None:
    """DeepSpeed joins the process group trainer.node.distributed started, quietly."""
    # DeepSpeed logs every rank's set-up at INFO; warnings and errors still come through.
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed's ZeRO uses collectives torch has renamed; the warnings say nothing to the user.
    warnings.filterwarnings(
        "ignore", message=r".*torch\.distributed\.\w+_tensor` is deprecated", category=FutureWarning
    )
    deepspeed.init_distributed(dist_backend=backend)


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(
        self, train, distributed, output_dir: Path, topology, model: torch.nn.Module, bf16: bool = False
    ):
        adopt_process_group(topology.backend)
        self.topology = topology
        self.timeout_s = distributed.timeout_s
        self.ds_config = deepspeed_config(train, distributed, topology.world_size, bf16)
        if topology.is_main:
            path = Path(output_dir) / "ds_config.json"
            path.write_text(json.dumps(self.ds_config, indent=2) + "\n")
        optimizer, scheduler = build_optimizer(model, train)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config
        )
        self.module = self.engine.module

    def train_step(self, micro_batches: Iterable[Batch]) -> torch.Tensor:
        # DeepSpeed scales each loss by 1/accumulation, reduces gradients and steps the optimizer and
        # scheduler (with clipping) at the accumulation boundary by itself.
        total, count = None, 0
        for batch in micro_batches:
            loss = self.engine(*batch)
            self.engine.backward(loss)
            self.engine.step()
            total = loss.detach().float() if total is None else total + loss.detach().float()
            count += 1
        return total / count

    def _forward(self, batch: Batch) -> torch.Tensor:
        return self.engine(*batch)

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.ds_config["zero_optimization"]["stage"] == 3:
            # One layer at a time onto rank 0's CPU, in the training dtype (16-bit with bf16 on).
            return self.engine._zero3_consolidated_16bit_state_dict()
        return super().full_state_dict()

    @contextlib.contextmanager
    def full_parameters(self) -> Iterator[None]:
        if self.ds_config["zero_optimization"]["stage"] == 3:
            with deepspeed.zero.GatheredParameters(list(self.module.parameters())):
                yield
        else:
            yield

    def save(self, directory: Path) -> None:
        self.engine.save_checkpoint(
            str(directory),
            tag=CHECKPOINT_TAG,
            save_latest=False,
            exclude_frozen_parameters=bool(frozen_parameter_names(self.module)),
        )
        ds_universal.dump_optimizer_state(self.engine, directory, "saved")

    def load(self, directory: Path) -> None:
        from trainer.node.checkpoint import read_state
        from trainer.node.distributed import gather

        universal = ds_universal.prepare(
            directory,
            tag=CHECKPOINT_TAG,
            saved_world_size=int(read_state(directory).get("world_size", self.topology.world_size)),
            world_size=self.topology.world_size,
            is_main=self.topology.is_main,
            timeout_s=self.timeout_s,
            share=lambda value: gather(value)[0],
            say=lambda line: print(line, flush=True) if self.topology.is_main else None,
        )
        # DeepSpeed reads the option at each load_checkpoint: on for this load only, so a user's JSON
        # with load_universal set still loads a same-world-size checkpoint's own shards.
        config = self.engine._config
        previous, config.load_universal_checkpoint = config.load_universal_checkpoint, universal is not None
        # Every rank would warn "MPU is not provided, setting tp size to 1": we have no tensor parallelism.
        quiet = logging.getLogger("DeepSpeed")
        level = quiet.level
        if universal is not None:
            quiet.setLevel(logging.ERROR)
        try:
            path, _ = self.engine.load_checkpoint(
                str(universal or directory),
                tag=CHECKPOINT_TAG,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
                # A LoRA checkpoint has no base weights: they come from the model directory, loaded already.
                load_module_strict=not frozen_parameter_names(self.module),
            )
        finally:
            config.load_universal_checkpoint = previous
            quiet.setLevel(level)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {directory}/{CHECKPOINT_TAG}")
        if universal is not None and self.ds_config["zero_optimization"]["stage"] == 3:
            self._mend_zero3_universal_load(universal)
        ds_universal.dump_optimizer_state(self.engine, directory, "loaded")

    def _mend_zero3_universal_load(self, universal: Path) -> None:
        """Two slips of ZeRO-3's universal load (DeepSpeed 0.19), found by comparing a resumed run with
        an uninterrupted one (tests/local/test_ds_resize.py):
        - every parameter group gets the first group's saved settings: the biases and norms would get
          the matrices' weight decay. Each group gets its own back, from the same file DeepSpeed read
          (written by this run's conversion and checked: trusted like the checkpoint);
        - every group's Adam state gets the same `step` tensor, which AdamW increments in place: with
          two groups the bias correction would count two steps per step. Each gets its own copy."""
        saved = torch.load(
            universal / CHECKPOINT_TAG / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=False
        )["optimizer_state_dict"]["param_groups"]
        for group, theirs in zip(self.optimizer.param_groups, saved, strict=True):
            group.update({k: v for k, v in theirs.items() if k != "params"})
        for state in self.optimizer.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
