"""A data source to tokenized samples for a Hugging Face model: read (trainer.node.hf.sources), each
record turned into a chat, a prompt and completion or a text (trainer.node.hf.formats), rendered and
tokenized, labelled (the replies only, unless data.train_on_inputs), weighted, cut or dropped where longer
than model.max_length; the eval samples held out.

Every rank does the same work on the same data and gets the same samples (before the process group
starts, so a bad record stops every rank at once with the same message). Samples are kept flat in
numpy arrays (sample i is `ids[offsets[i]:offsets[i + 1]]`), not as Python lists of ints: a dataset of
millions of tokens then costs 8 bytes a token, not about 70.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.configerror import ConfigError
from trainer.node.hf import formats, sources
from trainer.node.hf.chat import IGNORE, assistant_labels, render
from trainer.node.hf.sources import DataSource
from trainer.node.hf.templates import apply_template, renders_tool_calls


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


def concatenate(parts: Sequence[Samples]) -> Samples:
    """The samples of each part, one part after the other."""
    if len(parts) == 1:
        return parts[0]
    starts = np.cumsum([0] + [len(p.ids) for p in parts[:-1]])
    offsets = np.concatenate([[0]] + [p.offsets[1:] + start for p, start in zip(parts, starts, strict=True)])
    return Samples(
        ids=np.concatenate([p.ids for p in parts]).astype(np.int32),
        labels=np.concatenate([p.labels for p in parts]).astype(np.int32),
        offsets=offsets.astype(np.int64),
    )


def weighted_indices(count: int, weight: float, seed: int) -> np.ndarray:
    """Which of `count` records a weight trains per epoch: each one int(weight) times, plus a random
    (seeded) share of them for the fraction: 2 = all twice, 0.5 = a random half, 1.5 = all and a half."""
    whole = int(weight)
    extra = round((weight - whole) * count)
    chosen = (
        np.random.default_rng(seed).choice(count, extra, replace=False) if extra else np.zeros(0, np.int64)
    )
    return np.concatenate([np.tile(np.arange(count), whole), np.sort(chosen)]).astype(np.int64)


# --- tokenizing ----------------------------------------------------------------------------------


@dataclass
class Tokenized:
    samples: Samples
    """The training samples, weighted (a weight of 2 gives each twice)."""
    data_format: str
    records: int
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_untrained: int = 0
    template_note: str | None = None
    """Set when the chats were rendered with another template than the tokenizer's own."""
    format_note: str | None = None
    """What data.format auto chose, and why."""
    text_note: str | None = None
    """Set when prompt/completion strings are trained as plain text (no chat template)."""
    weight: float = 1.0
    held_out: Samples | None = None
    """The eval samples drawn from this source (hold_out), before weighting: none of them, by content,
    is among `samples`."""
    duplicates: int = 0
    """Samples that repeat another of this source exactly (the same tokens and labels)."""
    places: list[str] | None = None
    """Where each of the (unweighted, kept) samples came from (`data.path record 3`), for --show-sample."""
    order: np.ndarray | None = None
    """Which kept sample each of `samples` is (their order after the eval split and weighting)."""

    def summary(self, source: str, max_length: int, overlong: str) -> str:
        weighted = f" (weight {self.weight:g})" if self.weight != 1.0 else ""
        held = f" and {len(self.held_out)} held out for eval" if self.held_out is not None else ""
        parts = [
            f"data: {source}: {self.records} {self.data_format} records{weighted} -> "
            f"{len(self.samples)} samples{held}"
        ]
        if self.truncated:
            lost = f", {self.dropped_untrained} of them left with no trained token and dropped"
            parts.append(
                f"{self.truncated} longer than model.max_length={max_length} truncated"
                f"{lost if self.dropped_untrained else ''}"
            )
        if self.dropped_overlong:
            parts.append(f"{self.dropped_overlong} longer than model.max_length={max_length} dropped")
        if self.duplicates:
            parts.append(
                f"{self.duplicates} exact duplicates (kept; one sample for the eval split)"
                if self.held_out is not None
                else f"{self.duplicates} exact duplicates (kept)"
            )
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
    **settings: Any,
) -> Tokenized:
    """tokenize_source for one path (data.path's simple form)."""
    return tokenize_source(
        tokenizer, DataSource(path, key, data_format), max_length=max_length, overlong=overlong, **settings
    )


def tokenize_source(
    tokenizer: Any,
    source: DataSource,
    *,
    max_length: int,
    overlong: str,
    chat_template: str = "tokenizer",
    train_on_inputs: bool = False,
    endpoint: str = "",
    seed: int = 0,
    hold_out: float = 0.0,
) -> Tokenized:
    """Read a source and tokenize every record, cut or drop what is too long, hold out `hold_out` of its
    distinct samples for eval (chosen with seed), then weight what is left; ConfigError naming the key
    (and the record) for bad input."""
    loaded = sources.read(source, endpoint)
    if loaded.text is not None:
        if formats.canonical(source.format) not in ("auto", "text"):
            raise ConfigError(
                f"{source.section}.format",
                f"is {source.format}, but {source.name} is plain text (a .txt file is cut into "
                f"model.max_length pieces); set {source.section}.format: text, or give records as "
                ".jsonl/.json/.csv/.parquet",
            )
        pairs = _chunk_text(tokenizer, loaded.text, max_length)
        places = [f"{source.name} piece {i}" for i in range(len(pairs))]
        return _finish(_fit(pairs, places, "text", 1, max_length, overlong), source, seed, hold_out)
    records = loaded.records
    if records is None or len(records) == 0:
        raise ConfigError(source.key, f"{source.name} holds no records")
    data_format, format_note = formats.detect(
        records[0], source.format, _where(source, 0, records[0]), source.key
    )
    examples, places = [], []
    for index, record in enumerate(records):
        where = _where(source, index, record)
        examples.append(formats.to_example(record, data_format, where, source.key))
        places.append(where)
    template_note = None
    if any(example.messages is not None for example in examples):
        template_note = apply_template(tokenizer, chat_template)
    pairs = _tokenize_examples(tokenizer, examples, places, source.key, train_on_inputs)
    result = _finish(
        _fit(pairs, places, data_format, len(records), max_length, overlong), source, seed, hold_out
    )
    result.template_note, result.format_note = template_note, format_note
    if any(example.prompt_chars for example in examples):
        result.text_note = (
            f"{source.name}: prompt and completion strings are trained as the plain text prompt + "
            "completion, with no chat template and nothing between them; for a chat, use format alpaca "
            f"with {source.section}.columns {{instruction: <prompt column>, output: <completion column>}}"
        )
    return result


def _where(source: DataSource, index: int, record: Any) -> str:
    location = f"{source.name} record {index}"
    if isinstance(record, dict) and isinstance(record.get("id"), str | int):
        return f"{location} (id {record['id']!r})"
    return location


def _finish(fitted: tuple[Tokenized, list], source: DataSource, seed: int, hold_out: float) -> Tokenized:
    """The eval share drawn from the distinct samples, then the weight applied to the rest."""
    result, kept = fitted
    result.weight = source.weight
    keys = [(tuple(ids), tuple(labels)) for ids, labels in kept]
    first: dict[tuple, int] = {}
    for index, key in enumerate(keys):
        first.setdefault(key, index)
    result.duplicates = len(keys) - len(first)
    train = list(range(len(kept)))
    if hold_out > 0:
        distinct = sorted(first.values())
        count = max(1, round(hold_out * len(distinct)))
        if count >= len(distinct):
            raise ConfigError(
                "data.eval_fraction",
                f"{hold_out} of the {len(distinct)} distinct samples of {source.name} leaves none to train "
                "on; use a smaller fraction, or a separate eval file (data.eval_path)",
            )
        chosen = np.random.default_rng([seed, 1]).permutation(distinct)[:count]
        held = {keys[i] for i in chosen.tolist()}
        train = [i for i in train if keys[i] not in held]  # every copy of a held-out sample
        result.held_out = from_lists([kept[i] for i in sorted(chosen.tolist())])
    order = np.asarray(train, dtype=np.int64)
    if source.weight != 1.0:
        order = order[weighted_indices(len(order), source.weight, seed)]
    result.order = order
    result.samples = from_lists([kept[i] for i in order.tolist()])
    return result


def _chunk_text(tokenizer: Any, text: str, max_length: int) -> list[tuple[list[int], list[int]]]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = [ids[start : start + max_length] for start in range(0, len(ids), max_length)]
    return [(piece, piece) for piece in pieces if len(piece) >= 2]


def _tokenize_examples(
    tokenizer: Any, examples: list[formats.Example], places: list[str], key: str, train_on_inputs: bool
) -> list[tuple[list[int], list[int]]]:
    """(ids, labels) per example, in order; chats and texts are each tokenized in one batch."""
    pairs: list[Any] = [None] * len(examples)
    chats = [i for i, example in enumerate(examples) if example.messages is not None]
    texts = [i for i, example in enumerate(examples) if example.messages is None]
    if chats:
        for i, pair in zip(
            chats, _chat_pairs(tokenizer, examples, places, chats, key, train_on_inputs), strict=True
        ):
            pairs[i] = pair
    if texts:
        for i, pair in zip(texts, _text_pairs(tokenizer, examples, texts, train_on_inputs), strict=True):
            pairs[i] = pair
    return pairs


def _text_pairs(
    tokenizer: Any, examples: list[formats.Example], chosen: list[int], train_on_inputs: bool
) -> list[tuple[list[int], list[int]]]:
    """Texts with an end-of-sequence token added; a prompt's tokens (those starting before
    prompt_chars) carry no loss unless train_on_inputs."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError(
            "model.name_or_path",
            "the tokenizer has no end-of-sequence token (eos_token), which ends every text sample so the "
            "model learns to stop; use a tokenizer that defines eos_token",
        )
    encoded = tokenizer(
        [examples[i].text for i in chosen], add_special_tokens=True, return_offsets_mapping=True
    )
    pairs = []
    for i, ids, offsets in zip(chosen, encoded["input_ids"], encoded["offset_mapping"], strict=True):
        prompt = 0 if train_on_inputs else examples[i].prompt_chars
        labels = [
            token if start >= prompt else IGNORE for token, (start, _end) in zip(ids, offsets, strict=True)
        ]
        if not ids or ids[-1] != eos:
            ids, labels = [*ids, eos], [*labels, eos]
        pairs.append((list(ids), labels))
    return pairs


def _chat_pairs(
    tokenizer: Any,
    examples: list[formats.Example],
    places: list[str],
    chosen: list[int],
    key: str,
    train_on_inputs: bool,
) -> list[tuple[list[int], list[int]]]:
    rendered, all_spans = [], []
    tool_calls = renders_tool_calls(tokenizer)
    for i in chosen:
        messages = examples[i].messages
        for number, message in enumerate(messages):
            if "tool_calls" in message and not tool_calls:
                raise ConfigError(
                    key,
                    f"{places[i]}: message {number} has tool_calls, which the chat template does not render "
                    "(they would be trained as an empty reply); use a template that renders tool calls "
                    "(data.chat_template: tokenizer of a tool-calling model, or a Jinja file), or write the "
                    "call as the message's content",
                )
        text, spans = render(tokenizer, messages, places[i], key)
        rendered.append(text)
        all_spans.append(spans)
    # The template already wrote the special tokens (a BOS included, where it has one).
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    return [
        (ids, list(ids) if train_on_inputs else assistant_labels(ids, offsets, spans))
        for ids, offsets, spans in zip(
            encoded["input_ids"], encoded["offset_mapping"], all_spans, strict=True
        )
    ]


def _fit(
    pairs: list, places: list[str], data_format: str, records: int, max_length: int, overlong: str
) -> tuple[Tokenized, list]:
    """(the counts, the samples kept): each cut to max_length or dropped (data.overlong), and those left
    with no trained token dropped."""
    result = Tokenized(samples=from_lists([]), data_format=data_format, records=records, places=[])
    kept = []
    for (ids, labels), place in zip(pairs, places, strict=True):
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
            result.places.append(place)
    return result, kept
