"""The data half of a fine-tune: data.path or data.datasets (and data.eval_path) to the train and eval
samples and the rows a micro-batch draws from, with the notes for the log and the data section of run.json.

One function, `build_training_data`, so that what it depends on (the config and the tokenizer) and what
it produces (`TrainingData`) are in one place: the unit that is prepared once and reused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainer.configerror import ConfigError
from trainer.node.hf import dataset, sources
from trainer.node.hf.chat import IGNORE
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
    places: list[str] = field(default_factory=list)
    """Where each training sample came from (`FILE record 3`); empty where the data was reused from the
    prepared-data cache."""


def build_training_data(config: TrainerConfig, tokenizer: Any) -> TrainingData:
    """Read, tokenize, mix, split and pack; ConfigError naming the key (and the record) for bad input."""
    data = config.data
    max_length = config.model.max_length
    settings = {
        "max_length": max_length,
        "overlong": data.overlong,
        "chat_template": data.chat_template,
        "train_on_inputs": data.train_on_inputs,
        "endpoint": data.s3_endpoint_url,
    }
    notes: list[str] = []
    parts = []
    # The eval share is drawn from each dataset's own distinct samples before its weight applies: a
    # weighted copy of an eval sample never trains, and every dataset is evaluated in proportion.
    hold_out = data.eval_fraction if not data.eval_path else 0.0
    for index, source in enumerate(sources.data_sources(data)):
        # Each source draws its weighted share with its own seed: adding a dataset leaves the others'.
        tokenized = dataset.tokenize_source(
            tokenizer, source, seed=config.train.seed + index, hold_out=hold_out, **settings
        )
        notes += [n for n in (tokenized.template_note, tokenized.format_note, tokenized.text_note) if n]
        notes.append(tokenized.summary(source.name, max_length, data.overlong))
        parts.append((source, tokenized))
    if len(parts) > 1:
        notes.append(_mix_line(parts))
    train, held_out = dataset.concatenate([tokenized.samples for _, tokenized in parts]), None
    evaluated = sources.eval_source(data, parts[0][1].data_format)
    if evaluated is not None:
        tokenized_eval = dataset.tokenize_source(tokenizer, evaluated, seed=config.train.seed, **settings)
        notes.append("eval " + tokenized_eval.summary(evaluated.name, max_length, data.overlong))
        held_out = tokenized_eval.samples
        shared = len(_contents(held_out) & _contents(train))
        if shared:
            notes.append(
                f"eval: {shared} of the {len(held_out)} samples of {evaluated.name} are also training "
                "samples (the same tokens): the eval loss flatters them"
            )
    elif hold_out > 0:
        held_out = dataset.concatenate([t.held_out for _, t in parts if t.held_out is not None])
        counts = ", ".join(f"{s.name} {len(t.held_out or ())}" for s, t in parts)
        notes.append(
            f"eval: {len(held_out)} samples held out by data.eval_fraction={data.eval_fraction:g}: {counts} "
            "(drawn before weighting; none of them is trained on)"
        )
    places = [t.places[i] for _, t in parts for i in (t.order.tolist() if t.order is not None else [])]
    if len(train) == 0:
        summary = "; ".join(t.summary(s.name, max_length, data.overlong) for s, t in parts)
        raise ConfigError(parts[0][0].key, f"no sample is left to train on ({summary})")
    tokens, trained = int(train.lengths().sum()), int(train.label_counts().sum())
    notes.append(
        f"data: {len(train)} training samples, {tokens} tokens, {trained} of them trained "
        f"({trained / max(tokens, 1):.0%}; {'every token' if data.train_on_inputs else 'the replies only'}); "
        f"{len(held_out) if held_out is not None else 0} eval samples"
    )
    if data.packing:
        rows = pack(train.lengths(), max_length)
        fill = train.lengths().sum() / (len(rows) * max_length)
        notes.append(
            f"packing: {len(train)} samples into {len(rows)} rows of up to {max_length} tokens "
            f"({fill:.0%} full)"
        )
    else:
        rows = one_per_row(len(train))
    formats_used = sorted({tokenized.data_format for _, tokenized in parts})
    facts = {
        "path": " + ".join(source.name for source, _ in parts)
        if data.path or data.datasets
        else "pydoc_data.topics (bundled)",
        "format": formats_used[0] if len(formats_used) == 1 else ", ".join(formats_used),
        "records": sum(tokenized.records for _, tokenized in parts),
        "samples": len(train),
        "rows": len(rows),
        "tokens": int(train.lengths().sum()),
        "trained_tokens": int(train.label_counts().sum()),
        "truncated": sum(tokenized.truncated for _, tokenized in parts),
        "dropped": sum(t.dropped_overlong + t.dropped_untrained for _, t in parts),
        "eval_samples": len(held_out) if held_out is not None else 0,
        "duplicates": sum(tokenized.duplicates for _, tokenized in parts),
        "packing": data.packing,
        "max_length": max_length,
        "train_on_inputs": data.train_on_inputs,
        "chat_template": data.chat_template,
    }
    if len(parts) > 1:
        facts["datasets"] = [
            {
                "path": source.name,
                "format": tokenized.data_format,
                "weight": source.weight,
                "records": tokenized.records,
                "samples": len(tokenized.samples),
            }
            for source, tokenized in parts
        ]
    return TrainingData(
        train=train,
        eval=held_out if held_out is not None and len(held_out) else None,
        rows=rows,
        notes=notes,
        facts=facts,
        places=places,
    )


def show_job_sample(job: Any, index: int) -> str:
    """show_sample for a prepared job (`trainer train --dry-run --show-sample N`): a fine-tune's
    samples; ConfigError for the built-in GPT, whose samples are plain characters."""
    samples = getattr(job, "train", None)
    if getattr(job, "tokenizer", None) is None or not isinstance(samples, dataset.Samples):
        raise ConfigError(
            "--show-sample",
            "shows a fine-tune's samples (model.name_or_path set); the built-in tiny GPT trains on "
            "data.block_size characters of the text, every one",
        )
    return show_sample(TrainingData(train=samples, eval=None, rows=job.rows), job.tokenizer, index)


def show_sample(data: TrainingData, tokenizer: Any, index: int) -> str:
    """Training sample `index` (0-based, in the order prepared) as the model sees it: its text decoded
    token by token, each run marked [context] (no loss) or [trained] (the tokens that carry loss)."""
    if not 0 <= index < len(data.train):
        raise ConfigError(
            "--show-sample",
            f"{index} is not a training sample: there are {len(data.train)} (0 to {len(data.train) - 1})",
        )
    ids, labels = data.train.sample(index)
    trained = [bool(label != IGNORE) and position > 0 for position, label in enumerate(labels.tolist())]
    runs: list[tuple[bool, list[int]]] = []
    for token, is_trained in zip(ids.tolist(), trained, strict=True):
        if runs and runs[-1][0] == is_trained:
            runs[-1][1].append(token)
        else:
            runs.append((is_trained, [token]))
    text = "".join(
        f"[{'trained' if is_trained else 'context'}]{tokenizer.decode(tokens)}" for is_trained, tokens in runs
    )
    where = f": {data.places[index]}" if index < len(data.places) else ""
    header = (
        f"# sample {index} of {len(data.train)}{where} ({len(ids)} tokens, {sum(trained)} of them trained: "
        "the runs after 'trained' in brackets)"
    )
    return f"{header}\n{text}"


def _contents(samples: dataset.Samples) -> set[bytes]:
    return {samples.sample(i)[0].tobytes() for i in range(len(samples))}


def _mix_line(parts: list[tuple[sources.DataSource, dataset.Tokenized]]) -> str:
    total = sum(len(tokenized.samples) for _, tokenized in parts) or 1
    shares = ", ".join(
        f"{source.name} {len(tokenized.samples)} ({len(tokenized.samples) / total:.0%})"
        for source, tokenized in parts
    )
    return f"data mix: {len(parts)} datasets, {total} samples: {shares}"
