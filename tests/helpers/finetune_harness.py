"""Helpers for the fine-tuning tests: a tiny Hugging Face model and chat data built offline by the
project's own script (scripts/build_tiny_hf_model.py), once per test session.

Test modules import the fixtures they use (`from helpers.finetune_harness import tiny_model, chat_data`).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "scripts" / "build_tiny_hf_model.py"


def build(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BUILD), *args], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory) -> Path:
    """One directory per pytest session. A module that imports these fixtures gets its own copy of
    them (pytest keys a fixture by where it is defined), so each session-scoped fixture here runs once
    per module: a fixed path, not mktemp, makes the later modules find what the first one built (the
    builders below skip what is there; nothing writes into it after). It was a fresh directory per
    module: the tiny model and the chat data built again in each of unit/node's 10 modules (26-28 s
    of setup each at load 10)."""
    path = tmp_path_factory.getbasetemp() / "hf-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_model(hf_cache) -> Path:
    """A random-init Qwen2 (hidden 64, 2 layers) with a ChatML chat template, in HF format."""
    path = hf_cache / "tiny-qwen2"
    if not (path / "config.json").is_file():
        build("model", str(path))
    return path


@pytest.fixture(scope="session")
def chat_data(hf_cache) -> Path:
    """400 conversations in the Qwen guide's format (a JSON list)."""
    path = hf_cache / "conversations.json"
    if not path.is_file():
        build("data", str(path), "--samples", "400")
    return path


@pytest.fixture(scope="session")
def chat_data_600(hf_cache) -> Path:
    """600 conversations, for a run that must stay within one epoch: the generator repeats itself, and
    an eval split holds out every copy of its samples (of 400 with data.eval_fraction=0.1, 319 are left
    to train, fewer than 8 steps of 24 packed rows take)."""
    path = hf_cache / "conversations-600.json"
    if not path.is_file():
        build("data", str(path), "--samples", "600")
    return path


def finetune_sets(model: Path, data: Path, *extra: str) -> list[str]:
    """The overrides of a short fine-tuning run: 20 steps of 8 samples per rank, checkpoints at 10, 20."""
    return [
        f"model.name_or_path={model}",
        f"data.path={data}",
        "model.max_length=128",
        "train.max_steps=20",
        "train.log_every=5",
        "train.micro_batch_size=8",
        "checkpoint.save_steps=10",
        *extra,
    ]


def generate(final_dir: Path, prompt: str = "What is 3 plus 4?", *, adapter_base: Path | None = None) -> str:
    """What the saved model answers, loaded with plain transformers (and peft for an adapter)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(final_dir)
    if adapter_base is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(adapter_base), final_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(final_dir)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0][ids.shape[1] :])


LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="session")
def llama3_tokenizer(tiny_model, hf_cache) -> Path:
    """The tiny model's tokenizer with Llama 3's special tokens added (what data.chat_template=llama3
    needs), saved as a tokenizer directory."""
    from transformers import AutoTokenizer

    path = hf_cache / "llama3-tokenizer"
    if not (path / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(tiny_model)
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS})
        tokenizer.chat_template = None
        tokenizer.save_pretrained(path)
    return path


def records_file(path: Path, records: list[dict]) -> str:
    """Records written as what path's suffix says (.json list, .jsonl, .csv, .parquet, .arrow), or as
    a save_to_disk directory when it has none, with `datasets` itself."""
    import datasets

    suffix = path.suffix
    if suffix in (".json", ".jsonl"):  # as written by hand: each record its own shape
        path.write_text(
            json.dumps(records) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in records)
        )
        return str(path)
    table = datasets.Dataset.from_list(records)
    if suffix == ".csv":
        table.to_csv(str(path), index=False)
    elif suffix == ".parquet":
        table.to_parquet(str(path))
    elif suffix == ".arrow":
        import pyarrow as pa

        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.data.schema) as writer:
            writer.write_table(table.data.table)
    else:
        table.save_to_disk(str(path))
    return str(path)


@dataclass
class S3Server:
    endpoint: str
    env: dict[str, str]
    """The credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) and region clients use."""

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            region_name=self.env["AWS_DEFAULT_REGION"],
        )


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory) -> S3Server:
    """moto's S3 server (`python -m moto.server`) in its own process on a loopback port, until the module
    ends. Credentials are made-up values a test passes through the environment only."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert server.poll() is None, f"moto's server exited: {log.read_text()[-2000:]}"
                assert time.monotonic() < deadline, "moto's server did not listen within 60 s"
                time.sleep(0.1)
        yield S3Server(
            endpoint=f"http://127.0.0.1:{port}",
            env={
                "AWS_ACCESS_KEY_ID": "AKIATESTKEYID4DATA",
                "AWS_SECRET_ACCESS_KEY": "s3cr3t-never-logged-9f1c",
                "AWS_DEFAULT_REGION": "us-east-1",
            },
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
