"""The built-in job: a tiny character-level GPT (trainer.node.model) on data.path's text (or the bundled
text), cut into block_size samples (trainer.node.data). A `trainer.node.job.Job`.

torch is imported inside functions: a dry run counts the text's samples without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.node.data import Corpus, ShardedBatches, count_samples, load_corpus, read_text

if TYPE_CHECKING:
    import torch

    from trainer.node.config import TrainerConfig
    from trainer.node.distributed import Topology
    from trainer.node.engines import Engine


@dataclass
class TinyGPT:
    config: TrainerConfig
    corpus: Corpus | None
    """The encoded text; None in a dry run (the text is counted, not encoded)."""
    num_samples: int
    notes: list[str] = field(default_factory=list)

    @classmethod
    def prepare(cls, config: TrainerConfig, *, dry_run: bool = False) -> TinyGPT:
        if dry_run:
            return cls(config, None, count_samples(len(read_text(config.data.path)), config.data.block_size))
        corpus = load_corpus(config.data)
        return cls(config, corpus, corpus.num_samples)

    @property
    def _corpus(self) -> Corpus:
        assert self.corpus is not None, "a dry run's job has no corpus"
        return self.corpus

    @property
    def identity(self) -> dict[str, Any]:
        return self._corpus.identity

    @property
    def facts(self) -> dict[str, Any]:
        return {
            "path": self.config.data.path or "pydoc_data.topics (bundled)",
            "characters": len(self._corpus.ids),
            "vocab_size": len(self._corpus.vocab),
            "samples": self._corpus.num_samples,
        }

    def footprint(self, *, on_gpu: bool) -> tuple[int, int, float]:
        """Every parameter is trained, in fp32."""
        from trainer.node.model import parameter_count

        parameters = parameter_count(
            self.config.model, vocab_size=len(self._corpus.vocab), block_size=self.config.data.block_size
        )
        return parameters, parameters, 4

    def bf16_weights(self, on_gpu: bool) -> bool:
        return False

    def build_model(self, topology: Topology, *, bf16: bool) -> tuple[torch.nn.Module, str]:
        from trainer.node.model import GPT

        model = GPT(
            self.config.model, vocab_size=len(self._corpus.vocab), block_size=self.config.data.block_size
        )
        parameter_count = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions
        return model, f"{parameter_count:,} parameters"

    def after_engine(self, engine: Engine) -> str | None:
        return None

    def batches(self, topology: Topology, *, repeats: int) -> ShardedBatches:
        return ShardedBatches(
            self._corpus,
            repeats=repeats,
            micro_batch_size=self.config.train.micro_batch_size,
            rank=topology.rank,
            world_size=topology.world_size,
            seed=self.config.train.seed,
            device=topology.device,
        )

    def eval_batches(self, topology: Topology) -> None:
        return None

    def save_final(self, engine: Engine, output_dir: Path, *, is_main: bool, trained: bool) -> None:
        """The checkpoints are this model's only output."""
        return None
