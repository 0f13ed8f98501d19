"""data.path to tokenized samples for a Hugging Face model: read, detect the format, render chats,
tokenize, cut or drop what is longer than model.max_length, hold out the eval samples.

Every rank does the same work on the same file and gets the same samples (before the process group
starts, so a bad record stops every rank at once with the same message). Samples are kept flat in
numpy arrays (sample i is `ids[offsets[i]:offsets[i + 1]]`), not as Python lists of ints: a dataset of
millions of tokens then costs 8 bytes a token, not about 70.

Inputs: a JSON list (`.json`) or JSON lines (`.jsonl`, or any file whose first character is `{`) of
records, or a plain text file (cut into model.max_length pieces, every token trained). '' = the
bundled English text of the standard library, as plain text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.configerror import ConfigError
from trainer.node.hf.chat import IGNORE, assistant_labels, ensure_chat_template, normalize, render

FORMATS = ("conversations", "messages", "text")


@dataclass(frozen=True)
class Samples:
    ids: np.ndarray
    """All samples' token ids, one after the other (int32)."""
    labels: np.ndarray
    """The training target of each token: its own id where it carries loss, IGNORE (-100) elsewhere.
    Aligned with ids (the model shifts them by one)."""
    offsets: np.ndarray
    """Sample i is ids[offsets[i]:offsets[i + 1]] (int64, len = samples + 1)."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def label_counts(self) -> np.ndarray:
        """Tokens that carry loss per sample (the first token of a sample never does: nothing precedes it)."""
        trained = (self.labels != IGNORE).astype(np.int64)
        trained[self.offsets[:-1]] = 0
        return np.add.reduceat(trained, self.offsets[:-1]) if len(self) else np.zeros(0, np.int64)

    def sample(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = self.offsets[index], self.offsets[index + 1]
        return self.ids[start:end], self.labels[start:end]

    def subset(self, indices: Sequence[int]) -> Samples:
        return from_lists([self.sample(i) for i in indices])


def from_lists(pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> Samples:
    lengths = np.array([len(ids) for ids, _ in pairs], dtype=np.int64)
    offsets = np.zeros(len(pairs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = lambda column: (  # noqa: E731
        np.concatenate([np.asarray(pair[column], dtype=np.int32) for pair in pairs])
        if pairs
        else np.zeros(0, np.int32)
    )
    return Samples(ids=flat(0), labels=flat(1), offsets=offsets)


# --- reading -------------------------------------------------------------------------------------


def read_source(path: str, key: str = "data.path") -> tuple[list[tuple[str, Any]] | None, str | None]:
    """(records with their location for messages, None) for JSON input, (None, text) for plain text."""
    if not path:
        from pydoc_data.topics import topics

        return None, "\n\n".join(topics[name] for name in sorted(topics))
    source = Path(path).expanduser()
    if not source.is_file():
        raise ConfigError(key, f"no such file: {source}")
    try:
        raw = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(key, f"cannot read {source} as UTF-8 text: {err}") from None
    stripped = raw.lstrip()
    if source.suffix == ".json" or stripped.startswith("["):
        try:
            records = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ConfigError(key, f"{source} is not valid JSON: {err}") from None
        if not isinstance(records, list):
            raise ConfigError(
                key, f"{source}: expected a JSON list of records (got {type(records).__name__})"
            )
        return [(_where(f"{source} record {i}", r), r) for i, r in enumerate(records)], None
    if source.suffix in (".jsonl", ".ndjson") or stripped.startswith("{"):
        found = []
        for number, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError(key, f"{source}:{number}: not valid JSON ({err.msg})") from None
            found.append((_where(f"{source}:{number}", record), record))
        return found, None
    return None, raw


def _where(location: str, record: Any) -> str:
    if isinstance(record, dict) and isinstance(record.get("id"), str | int):
        return f"{location} (id {record['id']!r})"
    return location


def detect_format(records: list[tuple[str, Any]], configured: str, key: str = "data.path") -> str:
    if not records:
        raise ConfigError(key, "the file holds no records")
    where, first = records[0]
    if configured != "auto":
        return configured
    if isinstance(first, dict):
        for name in FORMATS:
            if name in first:
                return name
    keys = sorted(first) if isinstance(first, dict) else type(first).__name__
    raise ConfigError(
        "data.format",
        f"cannot tell the format of {where} (keys: {keys}); records need a `conversations`, `messages` "
        "or `text` field, or set data.format",
    )


# --- tokenizing ----------------------------------------------------------------------------------


@dataclass
class Tokenized:
    samples: Samples
    data_format: str
    records: int
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_untrained: int = 0
    template_note: str | None = None
    """Set when the tokenizer had no chat template and ChatML was used."""

    def summary(self, source: str, max_length: int, overlong: str) -> str:
        parts = [f"data: {source}: {self.records} {self.data_format} records -> {len(self.samples)} samples"]
        if self.truncated:
            lost = f", {self.dropped_untrained} of them left with no trained token and dropped"
            parts.append(
                f"{self.truncated} longer than model.max_length={max_length} truncated"
                f"{lost if self.dropped_untrained else ''}"
            )
        if self.dropped_overlong:
            parts.append(f"{self.dropped_overlong} longer than model.max_length={max_length} dropped")
        line = "; ".join(parts)
        if self.truncated or self.dropped_overlong:
            other = "drop" if overlong == "truncate" else "truncate"
            line += f" (data.overlong={overlong}; raise model.max_length or use data.overlong={other})"
        return line


def tokenize(
    tokenizer: Any,
    path: str,
    *,
    data_format: str,
    max_length: int,
    overlong: str,
    key: str = "data.path",
) -> Tokenized:
    """Read path and tokenize every record; ConfigError naming key (and the record) for bad input."""
    records, text = read_source(path, key)
    if text is not None:
        if data_format in ("conversations", "messages"):
            raise ConfigError(
                "data.format", f"is {data_format}, but {path or 'the bundled text'} is plain text"
            )
        return Tokenized(samples=_chunk_text(tokenizer, text, max_length), data_format="text", records=1)
    data_format = detect_format(records, data_format, key)
    template_note = None
    if data_format == "text":
        pairs = _text_records(tokenizer, records, key)
    else:
        template_note = ensure_chat_template(tokenizer)
        pairs = _chat_records(tokenizer, records, data_format)
    result = _fit(pairs, data_format, len(records), max_length, overlong)
    result.template_note = template_note
    return result


def _chunk_text(tokenizer: Any, text: str, max_length: int) -> Samples:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [ids[start : start + max_length] for start in range(0, len(ids), max_length)]
    return from_lists([(piece, piece) for piece in pieces if len(piece) >= 2])


def _text_records(
    tokenizer: Any, records: list[tuple[str, Any]], key: str
) -> list[tuple[list[int], list[int]]]:
    texts = []
    for where, record in records:
        value = record.get("text") if isinstance(record, dict) else None
        if not isinstance(value, str):
            raise ConfigError(key, f"{where}: each record needs a string field `text` (data.format=text)")
        texts.append(value)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(
            "model.name_or_path",
            "the tokenizer has no end-of-sequence token (eos_token), which ends every text sample so the "
            "model learns to stop; use a tokenizer that defines eos_token",
        )
    pairs = []
    for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]:
        ids = [*ids, eos] if not ids or ids[-1] != eos else list(ids)
        pairs.append((ids, ids))
    return pairs


def _chat_records(
    tokenizer: Any, records: list[tuple[str, Any]], data_format: str
) -> list[tuple[list[int], list[int]]]:
    rendered, all_spans = [], []
    for where, record in records:
        text, spans = render(tokenizer, normalize(record, data_format, where), where)
        rendered.append(text)
        all_spans.append(spans)
    # The template already wrote the special tokens (a BOS included, where it has one).
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    return [
        (ids, assistant_labels(ids, offsets, spans))
        for ids, offsets, spans in zip(
            encoded["input_ids"], encoded["offset_mapping"], all_spans, strict=True
        )
    ]


def _fit(pairs: list, data_format: str, records: int, max_length: int, overlong: str) -> Tokenized:
    result = Tokenized(samples=from_lists([]), data_format=data_format, records=records)
    kept = []
    for ids, labels in pairs:
        if len(ids) > max_length:
            if overlong == "drop":
                result.dropped_overlong += 1
                continue
            result.truncated += 1
            ids, labels = ids[:max_length], labels[:max_length]
            # A conversation cut before its first reply has nothing left to train on.
            if all(label == IGNORE for label in labels[1:]):
                result.dropped_untrained += 1
                continue
        if len(ids) >= 2 and any(label != IGNORE for label in labels[1:]):
            kept.append((ids, labels))
    result.samples = from_lists(kept)
    return result


def split_eval(samples: Samples, fraction: float, seed: int) -> tuple[Samples, Samples]:
    """(train, eval): round(fraction × samples) samples (at least 1) chosen with seed, on every rank alike."""
    count = max(1, round(fraction * len(samples)))
    if count >= len(samples):
        raise ConfigError(
            "data.eval_fraction",
            f"{fraction} of {len(samples)} samples leaves none to train on; use a smaller fraction",
        )
    order = np.random.default_rng(seed).permutation(len(samples))
    held_out = set(order[:count].tolist())
    train = [i for i in range(len(samples)) if i not in held_out]
    return samples.subset(train), samples.subset(sorted(held_out))
