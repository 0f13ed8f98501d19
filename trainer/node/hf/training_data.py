"""The data half of a fine-tune: data.path (and data.eval_path) to the train and eval samples and the
rows a micro-batch draws from, with the notes for the log and the data section of run.json.

One function, `build_training_data`, so that what it depends on (the config and the tokenizer) and what
it produces (`TrainingData`) are in one place: the unit that is prepared once and reused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer.configerror import ConfigError
from trainer.node.hf import dataset
from trainer.node.hf.packing import Rows, one_per_row, pack

if TYPE_CHECKING:
    from trainer.node.config import TrainerConfig


@dataclass
class TrainingData:
    train: dataset.Samples
    eval: dataset.Samples | None
    """None when nothing is held out."""
    rows: Rows
    """What one sample of a micro-batch is (a packed row holds several samples)."""
    notes: list[str] = field(default_factory=list)
    """Lines for the log: the template used, what was read, truncated, dropped, packed."""
    facts: dict[str, Any] = field(default_factory=dict)
    """The data section of run.json."""


def build_training_data(config: TrainerConfig, tokenizer: Any) -> TrainingData:
    """Read, tokenize, split and pack; ConfigError naming the key (and the record) for bad input."""
    data = config.data
    max_length = config.model.max_length
    notes = []
    tokenized = dataset.tokenize(
        tokenizer,
        data.path,
        data_format=data.format,
        max_length=max_length,
        overlong=data.overlong,
    )
    if tokenized.template_note:
        notes.append(tokenized.template_note)
    notes.append(tokenized.summary(data.path or "the bundled text", max_length, data.overlong))
    train, held_out = tokenized.samples, None
    if data.eval_path:
        evaluated = dataset.tokenize(
            tokenizer,
            data.eval_path,
            data_format=tokenized.data_format,
            max_length=max_length,
            overlong=data.overlong,
            key="data.eval_path",
        )
        notes.append("eval " + evaluated.summary(data.eval_path, max_length, data.overlong))
        held_out = evaluated.samples
    elif data.eval_fraction > 0:
        train, held_out = dataset.split_eval(train, data.eval_fraction, config.train.seed)
    if len(train) == 0:
        summary = tokenized.summary(data.path, max_length, data.overlong)
        raise ConfigError("data.path", f"no sample is left to train on ({summary})")
    if data.packing:
        rows = pack(train.lengths(), max_length)
        fill = train.lengths().sum() / (len(rows) * max_length)
        notes.append(
            f"packing: {len(train)} samples into {len(rows)} rows of up to {max_length} tokens "
            f"({fill:.0%} full)"
        )
    else:
        rows = one_per_row(len(train))
    facts = {
        "path": data.path or "pydoc_data.topics (bundled)",
        "format": tokenized.data_format,
        "records": tokenized.records,
        "samples": len(train),
        "rows": len(rows),
        "tokens": int(train.lengths().sum()),
        "trained_tokens": int(train.label_counts().sum()),
        "truncated": tokenized.truncated,
        "dropped": tokenized.dropped_overlong + tokenized.dropped_untrained,
        "eval_samples": len(held_out) if held_out is not None else 0,
        "packing": data.packing,
        "max_length": max_length,
    }
    return TrainingData(
        train=train,
        eval=held_out if held_out is not None and len(held_out) else None,
        rows=rows,
        notes=notes,
        facts=facts,
    )
