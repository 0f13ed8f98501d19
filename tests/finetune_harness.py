"""Helpers for the fine-tuning tests: a tiny Hugging Face model and chat data built offline by the
project's own script (scripts/build_tiny_hf_model.py), once per test session.

Test modules import the fixtures they use (`from finetune_harness import tiny_model, chat_data`).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BUILD = REPO / "scripts" / "build_tiny_hf_model.py"


def build(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BUILD), *args], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf-cache")


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
