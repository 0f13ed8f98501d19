"""The `data` section's keys for a fine-tune, checked when the config loads (on the controller too):
the formats, data.datasets entries and their columns, and no credential inside a path or URL.

Kept apart from the reading (trainer.node.hf.sources), which needs the config: the config needs
these checks, so they import nothing of it.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from trainer.configerror import ConfigError
from trainer.node.hf import formats
from trainer.redaction import has_url_credentials

#: data.datasets entries' keys, and the names other tools give them (answered, not accepted).
ENTRY_KEYS = ("path", "format", "weight", "columns", "split")
FOREIGN_ENTRY_KEYS = {"type": "format", "data_files": "path", "ds_type": "path (its suffix decides)"}
#: What data.format takes: the formats' registry (trainer.node.hf.formats), with `auto`.
FORMATS = formats.names()


def check_data_config(data: Any) -> None:
    """DataConfig's checks of the new keys (ConfigError with the key inside `data`), at config load.
    `data` is the DataConfig being built (typed loosely: trainer.node.data imports this module)."""
    if data.format not in FORMATS:  # the loader checks the Literal; a direct construction may not
        raise ConfigError("format", f"must be one of {', '.join(FORMATS)} (got {data.format!r})")
    if data.datasets and (data.path or data.columns or data.split != "train"):
        given = "path" if data.path else "columns" if data.columns else "split"
        raise ConfigError(
            given,
            "and data.datasets are both set; use data.path (with data.columns/data.split) for one dataset, "
            "or put every dataset, each with its own columns and split, in data.datasets",
        )
    for index, entry in enumerate(data.datasets):
        _check_entry(index, entry)
    _check_columns("columns", data.columns)
    for key, value in (("path", data.path), ("eval_path", data.eval_path), ("s3_endpoint_url",
                       data.s3_endpoint_url)):  # fmt: skip
        _refuse_credentials(key, value)
    if data.s3_endpoint_url and not re.match(r"https?://", data.s3_endpoint_url):
        raise ConfigError(
            "s3_endpoint_url", f"must be an http:// or https:// URL (got {data.s3_endpoint_url!r})"
        )


def _check_entry(index: int, entry: Any) -> None:
    key = f"datasets[{index}]"
    if not isinstance(entry, dict):
        raise ConfigError(
            key, f"must be a mapping such as {{path: data.jsonl, format: alpaca}} (got {entry!r})"
        )
    for name in entry:
        if name not in ENTRY_KEYS:
            ours = FOREIGN_ENTRY_KEYS.get(name)
            close = difflib.get_close_matches(str(name), ENTRY_KEYS, n=1)
            hint = f"; {name} is {ours} here" if ours else f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{key}.{name}", f"unknown key{hint} (known: {', '.join(ENTRY_KEYS)})")
    path = entry.get("path")
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"{key}.path", f"must be a non-empty path, s3:// URL or hub id (got {path!r})")
    _refuse_credentials(f"{key}.path", path)
    if entry.get("format", "auto") not in FORMATS:
        raise ConfigError(f"{key}.format", f"must be one of {', '.join(FORMATS)} (got {entry['format']!r})")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
        raise ConfigError(
            f"{key}.weight",
            f"must be a number above 0: how many times each record is trained per epoch (got {weight!r})",
        )
    if not isinstance(entry.get("split", "train"), str):
        raise ConfigError(f"{key}.split", f"must be a split name such as train (got {entry['split']!r})")
    _check_columns(f"{key}.columns", entry.get("columns", {}))


def _check_columns(key: str, columns: Any) -> None:
    if not isinstance(columns, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in columns.items()
    ):
        raise ConfigError(
            key,
            "must map the format's field names to your column names, e.g. {prompt: question} "
            f"(got {columns!r})",
        )


def _refuse_credentials(key: str, value: str) -> None:
    if has_url_credentials(value):
        raise ConfigError(
            key,
            "holds a credential (user:secret@ or a token parameter); never put one in the config, which is "
            "logged and passed on command lines: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or "
            "AWS_PROFILE) in the nodes' environment and give the path without it",
        )
