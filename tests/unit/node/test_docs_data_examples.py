"""docs/data.md's examples train what the page says: each format's example record is recognised as that
format and trains its reply (and nothing of the prompt), and the CSV example with `columns` trains a
chat. The records and the config are read from the page itself, so an edit there is tested."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from helpers.finetune_harness import hf_cache, records_file, tiny_model  # noqa: F401

from trainer.node.config import load_config
from trainer.node.hf.chat import IGNORE
from trainer.node.hf.training_data import build_training_data

PAGE = Path(__file__).resolve().parents[3] / "docs" / "data.md"
#: What the page says each example trains: its reply.
REPLIES = {"alpaca": "Paris.", "sharegpt": "4.", "messages": "4.", "prompt_completion": " blue."}


def examples() -> dict[str, dict]:
    """Each format's example record: the ```json block after its **name**."""
    found = {}
    for name, block in re.findall(r"^\*\*(\w+)\*\*.*?```json\n(.*?)```", PAGE.read_text(), re.S | re.M):
        found[name] = json.loads(block)
    return found


@pytest.fixture(scope="module")
def tokenizer(tiny_model):  # noqa: F811
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def trained_text(data, tokenizer, index: int = 0) -> tuple[str, str]:
    ids, labels = data.train.sample(index)
    trained = [
        token
        for position, (token, label) in enumerate(zip(ids, labels, strict=True))
        if label != IGNORE and position
    ]
    return tokenizer.decode(ids), tokenizer.decode(trained)


def test_the_page_has_an_example_of_every_format():
    assert sorted(examples()) == sorted(REPLIES)


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_each_formats_example_is_recognised_and_trains_its_reply(name, tiny_model, tokenizer, tmp_path):  # noqa: F811
    path = records_file(tmp_path / "example.jsonl", [examples()[name]] * 4)
    config = load_config(None, [f"model.name_or_path={tiny_model}", f"data.path={path}"])
    data = build_training_data(config, tokenizer)
    assert data.facts["format"] == name
    text, trained = trained_text(data, tokenizer)
    # The reply and what ends it (the template's end of turn, or the end-of-sequence token), no more.
    assert trained.startswith(REPLIES[name]), (text, trained)
    assert trained[len(REPLIES[name]) :] in ("<|im_end|>\n", "<|im_end|>", tokenizer.eos_token), trained


def test_the_csv_example_with_columns_trains_a_chat(tiny_model, tokenizer, tmp_path):  # noqa: F811
    section = PAGE.read_text().split("## Field names that differ: columns")[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    data_section = yaml.safe_load(block)["data"]
    csv = records_file(
        tmp_path / "qa.csv", [{"question": f"What is {i} + {i}?", "answer": f"{2 * i}."} for i in range(8)]
    )
    sets = [f"model.name_or_path={tiny_model}", f"data.path={csv}"]
    sets += [f"data.{key}={json.dumps(value)}" for key, value in data_section.items() if key != "path"]
    data = build_training_data(load_config(None, sets), tokenizer)
    text, trained = trained_text(data, tokenizer, 3)
    assert "<|im_start|>user\nWhat is 3 + 3?<|im_end|>" in text, text  # the question as the user's turn
    assert trained == "6.<|im_end|>\n", trained  # the answer, as the reply, is what is trained
