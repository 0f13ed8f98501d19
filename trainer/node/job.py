"""What a training job gives `trainer train` (torchtitan's model/data "spec", one protocol): the data
prepared before the process group, the model built after it, the batches, the final save, and what
run.json and a checkpoint record. Two implementations, chosen by `model.name_or_path`:

- `trainer.node.gpt_job.TinyGPT`: the built-in character-level GPT on data.path's text;
- `trainer.node.hf.job.FineTune`: a Hugging Face causal LM (full or LoRA) on chat or text records.

`prepare_job` picks one; neither imports this module (the protocol is structural).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainer.node.gpt_job import TinyGPT

if TYPE_CHECKING:
    import torch

    from trainer.node.config import TrainerConfig
    from trainer.node.distributed import Topology
    from trainer.node.engines import Engine
    from trainer.node.order import StepBatches


class Job(Protocol):
    """One training job. `prepare` (a classmethod of each implementation) runs on every rank before the
    process group starts and checks everything it can there: bad input stops every rank at once."""

    notes: list[str]
    """Lines for the log (what preparing the data found or chose)."""

    @property
    def num_samples(self) -> int:
        """What one sample of a micro-batch is counted in: the effective batch and epochs are over these."""
        ...

    @property
    def identity(self) -> dict[str, Any]:
        """What a checkpoint records of the vocabulary, tokenizer and data (checkpoint.IDENTITY_KEYS)."""
        ...

    @property
    def facts(self) -> dict[str, Any]:
        """The `data` section of run.json."""
        ...

    def footprint(self, *, on_gpu: bool) -> tuple[int, int, float]:
        """(parameters, trained parameters, bytes per weight) for the memory check before the start."""
        ...

    def bf16_weights(self, on_gpu: bool) -> bool:
        """The weights are loaded in bf16 (they then need an engine's bf16 mode)."""
        ...

    def build_model(self, topology: Topology, *, bf16: bool) -> tuple[torch.nn.Module, str]:
        """The model the engine trains (its forward returns the loss), after the process group starts,
        and a line for the log that says what it is."""
        ...

    def after_engine(self, engine: Engine) -> str | None:
        """What the job decides once the engine holds the model; a line for the log, or None."""
        ...

    def batches(self, topology: Topology, *, repeats: int) -> StepBatches:
        """This rank's micro-batches of each step."""
        ...

    def eval_batches(self, topology: Topology) -> Any | None:
        """This rank's (batch, label tokens) pairs for the eval loss, or None without eval data."""
        ...

    def save_final(self, engine: Engine, output_dir: Path, *, is_main: bool, trained: bool) -> Path | None:
        """After a run that ended well, on every rank: write the final model and return where it is, or
        None where the job writes none (or wrote it before and `trained` says no step ran since)."""
        ...


def prepare_job(config: TrainerConfig, world_size: int, *, dry_run: bool) -> Job:
    """The job the config describes, prepared (every rank, before the process group). dry_run: the data
    is checked and counted, and kept or written nowhere."""
    if config.model.name_or_path:
        # The model directory, tokenizer, LoRA targets and every record are checked here, on every
        # rank, before the process group: bad input stops all ranks at once with the same message.
        # Imported only here: it loads torch and transformers (`trainer train --help` stays quick).
        from trainer.node.hf.job import FineTune

        return FineTune.prepare(config, world_size, keep_data=not dry_run)
    return TinyGPT.prepare(config, dry_run=dry_run)
