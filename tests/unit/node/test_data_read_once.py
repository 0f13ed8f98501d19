"""A data file is read once per process at start, not once for the prepared data's cache key and
again for the checkpoint's data identity (on N nodes x G processes that was 2·N·G reads of a dataset
that may be gigabytes): the bytes this process reads, from the kernel's own count (/proc/self/io)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainer.node.config import load_config
from trainer.node.hf.sources import data_fingerprint, data_identity

MB = 1 << 20


def bytes_read() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.fixture
def chat_file(tmp_path) -> Path:
    path = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "x" * 900}, {"role": "assistant", "content": "y" * 900}]
    record = {"messages": turns}
    line = json.dumps(record) + "\n"
    path.write_text(line * (24 * MB // len(line)))
    return path


def test_the_cache_key_and_the_identity_read_the_data_once(chat_file):
    config = load_config(None, [f"data.path={chat_file}"])
    size = chat_file.stat().st_size
    before = bytes_read()
    fingerprint = data_fingerprint(config)
    identity = data_identity(config.data)
    read = bytes_read() - before
    assert identity["sha256"] == fingerprint["sources"][0]["content"]["sha256"]
    assert read < 1.2 * size, f"read {read / MB:.1f} MB for a {size / MB:.1f} MB data file"


def test_a_file_changed_since_is_read_again(chat_file):
    config = load_config(None, [f"data.path={chat_file}"])
    first = data_identity(config.data)["sha256"]
    with open(chat_file, "r+b") as handle:  # same size, other bytes: only the time and content differ
        handle.write(b" ")
    os.utime(chat_file, ns=(chat_file.stat().st_atime_ns, chat_file.stat().st_mtime_ns + 1_000_000))
    assert data_identity(config.data)["sha256"] != first
