"""What a checkpoint records of the run that wrote it (its state file's `fingerprint`), and why a run
whose settings, vocabulary, tokenizer or data differ is refused the resume.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path
from typing import Any

from trainer.configerror import ConfigError

#: Fingerprint entries that say what the model was trained on (see Corpus.identity in trainer.node.data
#: and trainer.node.hf.job): each a dict whose `sha256` is compared.
IDENTITY_KEYS = ("vocabulary", "tokenizer", "data")
#: The way out of a refused resume, for settings that differ.
RESUME_FIX = (
    "use the settings it was written with, or checkpoint.resume=never or another output_dir to start over"
)


def content_hash(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))  # parts cannot run into each other
        digest.update(data)
    return digest.hexdigest()


#: file_hash's results in this process, by what the file is and when it last changed: the prepared
#: data's cache key and the checkpoint's data identity both hash every data file at start, and a
#: dataset of gigabytes was read twice per rank.
_FILE_HASHES: dict[tuple[int, int, int, int], str] = {}


def file_hash(path: Path) -> str:
    """SHA-256 of a file's bytes, read in pieces (a dataset may be larger than memory allows twice).
    Read once per process while the file stays as it was (same inode, size and modification time)."""
    with open(path, "rb") as handle:
        stat = os.fstat(handle.fileno())
        seen = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if seen in _FILE_HASHES:
            return _FILE_HASHES[seen]
        digest = hashlib.sha256()
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    _FILE_HASHES[seen] = found = digest.hexdigest()
    return found


def resume_fingerprint(config: Any, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint must share with the config that resumes it (saved in its state file).
    identity: what the data and vocabulary are (IDENTITY_KEYS), from the training job (trainer.node.job)."""
    return {
        "model": dataclasses.asdict(config.model),
        "block_size": config.data.block_size,
        "engine": config.distributed.engine,
        # A LoRA checkpoint holds the adapter only; a packed run's data order is over other rows.
        "lora": dataclasses.asdict(config.lora),
        "packing": config.data.packing,
        **(identity or {}),
    }


def check_fingerprint(
    checkpoint: Path, saved: dict[str, Any], current: dict[str, Any], *, allow_data_change: bool
) -> list[str]:
    """ConfigError("checkpoint.resume") if the fingerprint `saved` in checkpoint and this run's `current`
    one (resume_fingerprint) differ in what a resume cannot change; warnings for the log (a checkpoint
    too old to say what data it was trained on)."""
    warnings = []
    recorded = [key for key in IDENTITY_KEYS if isinstance(saved.get(key), dict) and key in current]
    if not recorded and any(key in current for key in IDENTITY_KEYS):
        warnings.append(
            f"warning: {checkpoint} was written by an older trainer that did not record which data and "
            "vocabulary it was trained on: resuming without checking that they are unchanged"
        )
    for key in recorded:
        problem = _identity_problem(checkpoint, key, saved[key], current[key], allow_data_change)
        if problem:
            raise ConfigError("checkpoint.resume", problem)
    for key, value in current.items():
        if key in IDENTITY_KEYS:
            continue
        if isinstance(value, dict) and isinstance(saved.get(key), dict):
            # Settings added since the checkpoint was written are not in it: compare the ones it has.
            value = {name: setting for name, setting in value.items() if name in saved[key]}
        if key in saved and saved[key] != value:
            raise ConfigError(
                "checkpoint.resume",
                f"{checkpoint} was written with {key} = {saved[key]}, this config has {value}; {RESUME_FIX}",
            )
    return warnings


def _identity_problem(
    checkpoint: Path, key: str, saved: dict, now: dict, allow_data_change: bool
) -> str | None:
    """Why resuming with a changed vocabulary, tokenizer or data is refused (None: not refused)."""
    if saved.get("sha256") == now.get("sha256"):
        return None
    new_run = "start a new run: another output_dir (or run name), or checkpoint.resume=never"
    if key == "vocabulary":
        return (
            f"{checkpoint} was trained on another vocabulary ({saved.get('size')} tokens, sha256 "
            f"{str(saved.get('sha256'))[:12]}), this run's has {now.get('size')} tokens (sha256 "
            f"{str(now.get('sha256'))[:12]}): its token ids would mean other tokens; {new_run}"
        )
    if allow_data_change:
        return None
    what = (
        f"the tokenizer's files ({now.get('source')}) changed since {checkpoint} was written: text is split "
        "into other tokens"
        if key == "tokenizer"
        else f"the training data ({now.get('path')}) changed since {checkpoint} was written (sha256 "
        f"{str(saved.get('sha256'))[:12]}, now {str(now.get('sha256'))[:12]}): resuming would continue the "
        "old data order over other samples"
    )
    return f"{what}; {new_run}; or set checkpoint.allow_data_change=true to go on training on the new data"
