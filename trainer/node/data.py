"""Training data: text in, fixed-length character samples out, split across ranks deterministically.

A sample is `block_size + 1` consecutive characters (inputs and the next-character targets); the text
is cut into non-overlapping samples. Every rank reads the same text and builds the same vocabulary.
Which samples a step trains is the run's sample order (trainer.node.order): a function of the samples
consumed, not of the world size, so a resume continues sample-exact at any world size with the same
effective batch.

torch is imported inside functions: this module is loaded with the configuration on the controller.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from trainer.configerror import ConfigError, require
from trainer.node.hf.data_keys import check_data_config
from trainer.node.order import StepBatches

if TYPE_CHECKING:
    import numpy as np
    import torch


@dataclass(kw_only=True)
class DataConfig:
    path: str = ""
    """The training data ('' = the bundled English text of the standard library's `pydoc_data.topics`).
    The built-in tiny GPT reads a plain text file, or JSON lines with a `text` field per line. A Hugging
    Face model reads, through `datasets`: a JSON, JSON lines, CSV, parquet or arrow file (a glob too), a
    `save_to_disk` directory or one of data files, an `s3://bucket/key` path, a hub dataset id where a hub
    is reachable, or a plain `.txt` file (docs/data.md)."""
    block_size: int = 64
    """Characters per sample, which is also the model's context length."""
    repeats: int = 1
    """How many times the dataset is repeated per epoch (raise it for a dataset smaller than one batch)."""
    allow_dataset_oversubscription: bool = False
    """If the dataset cannot fill one effective batch, raise `repeats` to the minimum that can (logged)
    instead of stopping with an error."""
    # The formats' registry's names (trainer.node.hf.formats.names(), tests/unit/node/test_data_formats.py),
    # written out: the config loader and a reader of this class see them here.
    format: Literal[
        "auto", "messages", "sharegpt", "conversations", "alpaca", "prompt_completion", "text"
    ] = "auto"
    """With a Hugging Face model, the shape of data.path's records (docs/data.md): `alpaca` (instruction,
    input, output, optional system), `sharegpt` (a `conversations` list of from/value or role/content
    turns; `conversations` is another name for it), `messages` (OpenAI style, content a string or text
    parts), `prompt_completion` (TRL's prompt/completion), `text` (a `text` field, or a plain text file cut
    into model.max_length pieces); `auto` recognises it from the first record and says in the log what it
    chose. Chats are rendered with data.chat_template."""
    split: str = "train"
    """The split of data.path to read where it has several (a save_to_disk DatasetDict, a hub dataset)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Column mapping for data.path when its names differ from the format's: `{prompt: question,
    completion: answer}` reads the column `question` as `prompt`."""
    datasets: list[dict[str, Any]] = field(default_factory=list)
    """Several datasets mixed into one (instead of data.path): a list of `{path, format, weight, columns,
    split}`; each path is what data.path may be, format/columns/split as above (format defaults to
    data.format), weight (default 1) multiplies how many of its records are trained on per epoch (2: each
    twice, 0.5: a random half chosen with train.seed)."""
    s3_endpoint_url: str = ""
    """The endpoint of an S3-compatible store (R2, MinIO, Ceph) for s3:// paths ('' = AWS_ENDPOINT_URL where
    set, else AWS S3). Credentials come from the nodes' standard AWS variables or profile, never from here."""
    chat_template: str = "tokenizer"
    """How chats are rendered: `tokenizer` (its own template; ChatML where it has none), `chatml`,
    `llama3`, or the path of a Jinja template file."""
    train_on_inputs: bool = False
    """Train on every token (prompts, system and user turns too), not only on the replies."""
    packing: bool = False
    """Pack several samples into each model.max_length row (fewer pad tokens, faster); attention stays
    within each sample where the model supports it (checked at start, named in the log)."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """A sample longer than model.max_length tokens is cut to it (`truncate`) or left out (`drop`);
    the log says how many."""
    eval_fraction: float = 0.0
    """Hold out this fraction of the samples (chosen with train.seed) for the eval loss; 0 = none."""
    eval_path: str = ""
    """A separate eval file in the same format as data.path ('' = none, or data.eval_fraction)."""
    prepare_once: bool = True
    """With a Hugging Face model: one process of the job reads, tokenizes and packs the data into
    data.prepared_dir and every other process, on every node, waits and memory-maps it; a later run with
    the same inputs reuses it (the log says which). false: every process prepares its own copy."""
    prepared_dir: str = ""
    """Where prepared data is kept, one entry per set of inputs (the data's content, the tokenizer, this
    section, model.max_length): a directory of this account's that no other can write. '' =
    <cluster_shared_dir>/prepared-data under `trainer launch`, else OUTPUT_DIR/prepared-data. Nodes that
    do not share it each prepare their own copy. The 4 entries used last, and any used within a day, are
    kept; delete it by hand (with no job running from it) to reclaim the rest."""

    def __post_init__(self) -> None:
        require(self.block_size >= 2, "block_size", f"must be at least 2 (got {self.block_size})")
        require(self.repeats >= 1, "repeats", f"must be at least 1 (got {self.repeats})")
        require(
            0.0 <= self.eval_fraction < 1.0,
            "eval_fraction",
            f"must be in [0, 1): the share of samples held out (got {self.eval_fraction})",
        )
        require(
            not (self.eval_fraction > 0 and self.eval_path),
            "eval_path",
            "and data.eval_fraction are both set; use one: a separate eval file or a held-out fraction",
        )
        check_data_config(self)


class DataError(Exception):
    """The data cannot be used as configured (exit code DATA_ERROR); the message says how to fix it."""


def read_text(path: str) -> str:
    """The training text from data.path, or the bundled text when it is empty."""
    if not path:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[name] for name in sorted(topics))
    source = Path(path).expanduser()
    if not source.is_file():
        raise ConfigError("data.path", f"no such file: {source} (use '' for the bundled text)")
    try:
        raw = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("data.path", f"cannot read {source} as UTF-8 text: {err}") from None
    if source.suffix in (".jsonl", ".ndjson") or raw.lstrip().startswith("{"):
        return _read_json_lines(source, raw)
    return raw


def _read_json_lines(source: Path, raw: str) -> str:
    texts = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{source}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise DataError(f"{source}:{number}: each JSON line needs a string field `text`")
        texts.append(record["text"])
    return "\n\n".join(texts)


@dataclass(frozen=True)
class Corpus:
    """The encoded text and its vocabulary (sorted characters, identical on every rank)."""

    vocab: str
    ids: torch.Tensor
    block_size: int
    path: str = ""
    """data.path as configured ('' = the bundled text)."""
    text_sha256: str = ""

    @property
    def num_samples(self) -> int:
        return (len(self.ids) - 1) // self.block_size

    @property
    def identity(self) -> dict[str, dict[str, Any]]:
        """What a checkpoint records of its data (checkpoint.IDENTITY_KEYS): the vocabulary (the token ids
        are positions in it) and the text, by content."""
        from trainer.node.checkpoint import content_hash

        return {
            "vocabulary": {"size": len(self.vocab), "sha256": content_hash(self.vocab)},
            "data": {"path": self.path or "the bundled text", "sha256": self.text_sha256},
        }


def load_corpus(config: DataConfig) -> Corpus:
    import torch

    text = read_text(config.path)
    vocab = "".join(sorted(set(text)))
    lookup = {ch: i for i, ch in enumerate(vocab)}
    ids = torch.tensor([lookup[ch] for ch in text], dtype=torch.long)
    count_samples(len(text), config.block_size)
    from trainer.node.checkpoint import content_hash

    return Corpus(
        vocab=vocab, ids=ids, block_size=config.block_size, path=config.path, text_sha256=content_hash(text)
    )


def count_samples(characters: int, block_size: int) -> int:
    """The samples a text of `characters` holds (as Corpus.num_samples); ConfigError if not one: the
    same answer for `--dry-run` (which counts without building the corpus) and a real run."""
    samples = (characters - 1) // block_size
    if samples < 1:
        raise ConfigError(
            "data.block_size",
            f"{block_size} is too large for the text of data.path ({characters} characters): one sample "
            f"needs data.block_size + 1 = {block_size + 1}; use a smaller data.block_size or a longer text",
        )
    return samples


def required_repeats(
    num_samples: int, config: DataConfig, micro_batch_size: int, world_size: int, accumulation: int
) -> tuple[int, str | None]:
    """The repeats to train with and a log line if oversubscription raised them; DataError if too small.

    One optimizer step consumes micro_batch_size × world_size × accumulation samples; a dataset
    (times its repeats) smaller than that cannot fill a single step.
    """
    effective = micro_batch_size * world_size * accumulation
    available = num_samples * config.repeats
    if available >= effective:
        return config.repeats, None
    minimum = math.ceil(effective / num_samples)
    arithmetic = (
        f"effective batch = train.micro_batch_size × world size × train.gradient_accumulation_steps"
        f" = {micro_batch_size} × {world_size} × {accumulation} = {effective} samples, but the dataset has"
        f" {num_samples} samples × data.repeats {config.repeats} = {available}"
    )
    if config.allow_dataset_oversubscription:
        return minimum, f"dataset oversubscribed: {arithmetic}; training with data.repeats = {minimum}"
    raise DataError(
        f"the dataset is smaller than one effective batch: {arithmetic}.\nWays out:\n"
        f"  1. a smaller batch: --set train.micro_batch_size=N or train.gradient_accumulation_steps=N\n"
        f"  2. fewer processes (world size {world_size}: fewer nodes or processes per node)\n"
        f"  3. more repeats: --set data.repeats={minimum}\n"
        f"  4. let the trainer compute the repeats: --set data.allow_dataset_oversubscription=true"
    )


class ShardedBatches(StepBatches):
    """This rank's micro-batches of each step (trainer.node.order: the run's sample order, split across
    ranks and accumulation): (inputs, targets) tensors of micro_batch_size samples on the device."""

    def __init__(
        self,
        corpus: Corpus,
        *,
        repeats: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device | str = "cpu",
    ):
        import torch

        super().__init__(
            num_samples=corpus.num_samples,
            repeats=repeats,
            micro_batch_size=micro_batch_size,
            rank=rank,
            world_size=world_size,
            seed=seed,
        )
        self.corpus = corpus
        self.device = torch.device(device)
        self._window = torch.arange(corpus.block_size + 1)

    def step_tokens(self, step: int) -> int:
        return self.effective_batch * self.corpus.block_size

    def _collate(self, chosen: np.ndarray, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        starts = torch.from_numpy(chosen) * self.corpus.block_size
        chunk = self.corpus.ids[starts[:, None] + self._window]
        x, y = chunk[:, :-1], chunk[:, 1:]
        if self.device.type != "cpu":
            x, y = (
                x.pin_memory().to(self.device, non_blocking=True),
                y.pin_memory().to(self.device, non_blocking=True),
            )
        return x, y
