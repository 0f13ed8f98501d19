"""Fine-tuning a Hugging Face model (a `trainer.node.job.Job`), in the order `trainer train` needs it:

1. `FineTune.prepare` (every rank, before the process group starts): the model directory, its config
   and tokenizer, the LoRA targets (on a weightless copy of the model), Q-LoRA's needs, the data
   read, tokenized, split and packed. Bad input stops here with a ConfigError naming the key.
2. `build_model` (after the process group): the weights, LoRA, the loss wrapper the engines train.
3. `after_engine` (`check_packing`): does the model keep attention within packed samples?
4. `batches` / `eval_batches`, then the loop; `save_final` (`write_final`) at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.configerror import ConfigError
from trainer.node.hf import dataset, prepared
from trainer.node.hf.final import FINAL, save_pretrained, unwrap_state
from trainer.node.hf.model import check_source, load_model_config, load_tokenizer, pad_token_id
from trainer.node.hf.packing import Rows, one_per_row

if TYPE_CHECKING:
    import torch

    from trainer.node.config import TrainerConfig
    from trainer.node.data import DataConfig
    from trainer.node.distributed import Topology
    from trainer.node.engines import Engine
    from trainer.node.hf.batches import EvalBatches, FinetuneBatches


@dataclass
class FineTune:
    config: TrainerConfig
    source: str
    """The model directory (or hub id)."""
    tokenizer: Any
    model_config: Any
    train: dataset.Samples
    eval: dataset.Samples | None
    rows: Rows
    target_modules: list[str] | None
    notes: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    """The data section of run.json."""
    identity: dict[str, Any] = field(default_factory=dict)
    """What a checkpoint records of the tokenizer and the data (checkpoint.IDENTITY_KEYS)."""
    reset_positions: bool = False
    """Packed rows restart position_ids per sample (the model then keeps attention within samples)."""
    model: Any = None
    """The transformers (or peft) model, once built."""

    @property
    def num_samples(self) -> int:
        """Rows: what one sample of a micro-batch is (a packed row holds several samples)."""
        return len(self.rows)

    @classmethod
    def prepare(cls, config: TrainerConfig, world_size: int, *, keep_data: bool = True) -> FineTune:
        """keep_data=False (a dry run): the data is prepared here and written nowhere."""
        from transformers.utils import logging as transformers_logging

        # Every rank would draw its own loading and saving bars into the one log.
        transformers_logging.disable_progress_bar()
        source = check_source(config.model.name_or_path)
        model_config = load_model_config(config.model, source)
        config.model.check_positions(model_config)  # before any data is read: rows past them train wrong
        tokenizer = load_tokenizer(config.model, source)
        notes = []
        target_modules = _check_lora(config, model_config) if config.lora.enabled else None
        # One process of the job prepares the data; the others wait and memory-map it (hf/prepared.py).
        data = prepared.training_data(config, tokenizer, keep=keep_data)
        notes.extend(data.notes)
        return cls(
            config=config,
            source=source,
            tokenizer=tokenizer,
            model_config=model_config,
            train=data.train,
            eval=data.eval,
            rows=data.rows,
            target_modules=target_modules,
            notes=notes,
            facts=data.facts,
            identity=_identity(source, tokenizer, config.data),
        )

    def parameter_counts(self) -> tuple[int, int]:
        """(all parameters, trained ones) from a weightless copy of the model; a LoRA adapter's own few
        are not counted (the estimate they feed is a lower bound)."""
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(
                self.model_config, trust_remote_code=self.config.model.trust_remote_code
            )
        total = sum(p.numel() for p in skeleton.parameters())
        return total, 0 if self.config.lora.enabled else total

    def footprint(self, *, on_gpu: bool) -> tuple[int, int, float]:
        """(parameters, trained ones, bytes per weight: half a byte for Q-LoRA's 4-bit base)."""
        parameters, trained = self.parameter_counts()
        if self.config.lora.qlora:
            return parameters, trained, 0.5
        from trainer.node.engines.master_weights import wanted

        dtype = self.weights_dtype(on_gpu)
        # Trained bf16 weights under ddp with fp32 masters: as much memory as fp32 weights, at least.
        full_ddp = not self.config.lora.enabled and self.config.distributed.engine == "ddp"
        masters = full_ddp and wanted(dtype, self.config.train.optimizer)
        return parameters, trained, 4 if masters else dtype.itemsize

    def bf16_weights(self, on_gpu: bool) -> bool:
        import torch

        return self.weights_dtype(on_gpu) == torch.bfloat16

    def weights_dtype(self, on_gpu: bool) -> torch.dtype:
        from trainer.node import speedups
        from trainer.node.hf.model import weights_dtype

        config = self.config
        # ddp keeps fp32 masters of bf16 weights itself (the bf16_master speed-up), as DeepSpeed does; a run
        # told to compute in fp32 (train.mixed_precision=no) keeps fp32 weights.
        masters = (
            config.distributed.engine == "ddp"
            and config.train.mixed_precision != "no"
            and speedups.enabled("bf16_master")
        )
        full_update = not config.lora.enabled and (
            config.distributed.engine == "accelerate" or (config.distributed.engine == "ddp" and not masters)
        )
        return weights_dtype(config.model, updates_all_weights_itself=full_update, on_gpu=on_gpu)

    def build_model(self, topology: Topology, *, bf16: bool) -> tuple[torch.nn.Module, str]:
        """The loss wrapper around the loaded model (LoRA applied) and a line for the log."""
        import torch

        from trainer.node.hf.lora import apply_lora
        from trainer.node.hf.model import CausalLMLoss, load_model

        config = self.config
        on_gpu = topology.device.startswith("cuda")
        dtype = self.weights_dtype(on_gpu)
        keep_alive = _zero3_init(config, topology, bf16=bf16 or dtype == torch.bfloat16)
        model = load_model(
            config.model,
            self.source,
            dtype=dtype,
            qlora=config.lora.qlora,
            device=topology.device,
            gradient_checkpointing=config.train.gradient_checkpointing,
        )
        del keep_alive
        if config.lora.enabled:
            model = apply_lora(
                model,
                config.lora,
                self.target_modules,
                gradient_checkpointing=config.train.gradient_checkpointing,
            )
        self.model = model
        total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        trained = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
        what = (
            f"a LoRA adapter (r={config.lora.r}{', 4-bit base' if config.lora.qlora else ''}): "
            f"{trained:,} of {total:,} parameters"
            if config.lora.enabled
            else f"{total:,} parameters"
        )
        return CausalLMLoss(
            model
        ), f"{self.source} ({self.model_config.model_type}, {str(dtype).removeprefix('torch.')}), {what}"

    def after_engine(self, engine: Engine) -> str | None:
        return self.check_packing(engine)

    def check_packing(self, engine: Engine) -> str | None:
        """Decide how packed rows are fed, by measuring: the loss on sample B after prefix A1 and after
        prefix A2, with B's positions restarted. Equal: the model masks by packed position_ids (no
        attention between samples). Different: it does not, and rows are fed as plain packing."""
        if not self.config.data.packing:
            return None
        import torch

        from trainer.node.hf.chat import IGNORE

        vocab = min(len(self.tokenizer), self.model_config.vocab_size)
        generator = torch.Generator().manual_seed(0)
        prefix_1, prefix_2, sample = (torch.randint(0, vocab, (16,), generator=generator) for _ in range(3))
        device = next(engine.module.parameters()).device

        def loss(prefix: torch.Tensor, restart: bool) -> float:
            input_ids = torch.cat([prefix, sample])[None].to(device)
            labels = input_ids.clone()
            labels[0, : len(prefix) + 1] = IGNORE  # B's own tokens only, not its first (predicted from A)
            positions = torch.cat([torch.arange(len(prefix)), torch.arange(len(sample))])[None].to(device)
            batch = (input_ids, labels, positions if restart else None, torch.tensor(1.0, device=device))
            return float(engine.evaluate(batch))

        crossing = abs(loss(prefix_1, False) - loss(prefix_2, False))
        masked = abs(loss(prefix_1, True) - loss(prefix_2, True))
        self.reset_positions = crossing > 0 and masked <= 1e-3 * crossing
        if self.reset_positions:
            return "packing: attention stays within each sample (position_ids restart per sample)"
        return (
            "packing: this model lets attention cross packed samples (it does not mask by position_ids): "
            "plain packing, each sample sees the ones before it in its row"
        )

    def _collator(self, samples: dataset.Samples, rows: Rows, device: str):
        from trainer.node.hf.batches import Collator

        return Collator(
            samples,
            rows,
            pad_id=pad_token_id(self.tokenizer),
            reset_positions=self.reset_positions,
            device=device,
        )

    def batches(self, topology: Topology, *, repeats: int) -> FinetuneBatches:
        from trainer.node.hf.batches import FinetuneBatches

        train = self.config.train
        return FinetuneBatches(
            self._collator(self.train, self.rows, topology.device),
            repeats=repeats,
            micro_batch_size=train.micro_batch_size,
            rank=topology.rank,
            world_size=topology.world_size,
            seed=train.seed,
        )

    def eval_batches(self, topology: Topology) -> EvalBatches | None:
        from trainer.node.hf.batches import EvalBatches

        if self.eval is None:
            return None
        return EvalBatches(
            self._collator(self.eval, one_per_row(len(self.eval)), topology.device),
            micro_batch_size=self.config.train.micro_batch_size,
            rank=topology.rank,
            world_size=topology.world_size,
        )

    def save_final(self, engine: Engine, output_dir: Path, *, is_main: bool, trained: bool) -> Path | None:
        """write_final, unless a resume that trained no step finds the final model already there."""
        if not trained and (Path(output_dir) / FINAL).is_dir():
            return None
        return self.write_final(engine, output_dir, is_main=is_main)

    def write_final(self, engine: Engine, output_dir: Path, *, is_main: bool) -> Path:
        """OUTPUT_DIR/final/ (see trainer.node.hf.final); call on every rank (ZeRO-3 gathers)."""
        state = engine.full_state_dict()
        directory = Path(output_dir) / FINAL
        if is_main:
            save_pretrained(self.model, unwrap_state(state), self.tokenizer, directory)
        return directory


#: The files a tokenizer is loaded from (those a model directory has).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


def _identity(source: str, tokenizer: Any, data: DataConfig) -> dict[str, Any]:
    """The vocabulary (token to id), the tokenizer's files (or, for a hub id, its serialized form) and
    the data (every source: files, directories, s3 objects, hub revisions), by content: a resume refuses
    a change it was not told to accept."""
    import json

    from trainer.node.checkpoint import content_hash
    from trainer.node.hf.sources import data_identity

    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    directory = Path(source)
    if directory.is_dir():
        names = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
        tokenizer_hash = content_hash(*(part for n in names for part in (n, (directory / n).read_bytes())))
    else:
        tokenizer_hash = content_hash(tokenizer.backend_tokenizer.to_str())
    return {
        "vocabulary": {"size": len(vocabulary), "sha256": content_hash(json.dumps(vocabulary))},
        "tokenizer": {"source": source, "sha256": tokenizer_hash},
        "data": data_identity(data),
    }


def _check_lora(config: TrainerConfig, model_config: Any) -> list[str]:
    """LoRA's target modules, checked on a weightless copy of the model; Q-LoRA's needs."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.node.hf.lora import check_target_modules

    if config.lora.qlora:
        if not torch.cuda.is_available():
            raise ConfigError(
                "lora.qlora",
                "4-bit quantization (bitsandbytes) runs on CUDA GPUs only and this node has none; "
                "use lora.qlora=false for plain LoRA on the CPU",
            )
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise ConfigError(
                "lora.qlora",
                "needs bitsandbytes, which is not installed on this node; install the `qlora` extra "
                "(pip install 'clustertrain[qlora]') or use lora.qlora=false",
            ) from None
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(
            model_config, trust_remote_code=config.model.trust_remote_code
        )
    return check_target_modules(config.lora, skeleton)


def _zero3_init(config: TrainerConfig, topology: Topology, *, bf16: bool) -> Any:
    """Under ZeRO-3, transformers loads the weights straight into partitions (deepspeed.zero.Init) while
    the returned object lives, so no rank ever holds the whole model: what lets a 72B model load."""
    if config.distributed.engine != "deepspeed" or config.distributed.zero_stage != 3:
        return None
    import os

    if not topology.device.startswith("cuda"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as create_engine does, before deepspeed loads
    from transformers.integrations import HfDeepSpeedConfig

    from trainer.node.engines.deepspeed import adopt_process_group, deepspeed_config

    # zero.Init partitions over DeepSpeed's view of the process group: it must adopt ours first.
    adopt_process_group(topology.backend)
    return HfDeepSpeedConfig(deepspeed_config(config.train, config.distributed, topology.world_size, bf16))
