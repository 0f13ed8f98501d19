"""Where fine-tuning data comes from: every kind of file and directory `datasets` reads gives the same
samples, a CSV or parquet file is read as records (never trained as text), several datasets mix by
weight, columns are mapped, what cannot be read is refused by name before training, and the data's
fingerprint follows its content.

Files are written by the tests with `datasets` and pyarrow; the tokenizer is the tiny one
scripts/build_tiny_hf_model.py builds offline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers.finetune_harness import hf_cache, records_file, tiny_model  # noqa: F401

from trainer import exitcodes
from trainer.cli import main
from trainer.configerror import ConfigError
from trainer.node.checkpoint import file_hash
from trainer.node.config import load_config
from trainer.node.hf import dataset
from trainer.node.hf.sources import DataSource, data_fingerprint, data_identity
from trainer.node.hf.training_data import build_training_data

ALPACA = [
    {
        "instruction": f"Add {i} and {i + 1}.",
        "input": "" if i % 2 else f"Show the sum of {i} and {i + 1}.",
        "output": f"{i} plus {i + 1} is {2 * i + 1}.",
    }
    for i in range(12)
]
QA = [{"question": f"What is {i} times 2?", "answer": f"{i} times 2 is {2 * i}."} for i in range(10)]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):  # noqa: F811
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def tokenize(tokenizer, path: str, **settings):
    return dataset.tokenize(tokenizer, path, data_format="auto", max_length=256, overlong="drop", **settings)


def prepare(tiny_model, *sets: str):  # noqa: F811
    config = load_config(None, [f"model.name_or_path={tiny_model}", "model.max_length=256", *sets])
    from transformers import AutoTokenizer

    return build_training_data(config, AutoTokenizer.from_pretrained(tiny_model))


def test_every_kind_of_file_and_directory_gives_the_same_samples(tokenizer, tmp_path):
    import datasets

    reference = tokenize(tokenizer, records_file(tmp_path / "a.jsonl", ALPACA))
    assert (reference.data_format, len(reference.samples)) == ("alpaca", 12)
    assert reference.format_note == "format auto -> alpaca (records have instruction/input/output)"
    shards = tmp_path / "shards"
    shards.mkdir()
    records_file(shards / "part-0.parquet", ALPACA[:6])
    records_file(shards / "part-1.parquet", ALPACA[6:])
    split_dir = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(QA), "test": datasets.Dataset.from_list(ALPACA)}
    ).save_to_disk(str(split_dir))
    kinds = {
        "json": records_file(tmp_path / "a.json", ALPACA),
        "csv": records_file(tmp_path / "a.csv", ALPACA),
        "parquet": records_file(tmp_path / "a.parquet", ALPACA),
        "arrow": records_file(tmp_path / "a.arrow", ALPACA),
        "save_to_disk": records_file(tmp_path / "saved", ALPACA),
        "directory of parquet files": str(shards),
        "glob": str(shards / "*.parquet"),
    }
    for kind, path in kinds.items():
        read = tokenize(tokenizer, path)
        assert read.data_format == "alpaca", kind
        assert np.array_equal(read.samples.ids, reference.samples.ids), kind
        assert np.array_equal(read.samples.labels, reference.samples.labels), kind
    # A DatasetDict: the split named, or a clear refusal listing the ones it has.
    chosen = dataset.tokenize_source(
        tokenizer, DataSource(str(split_dir), split="test"), max_length=256, overlong="drop"
    )
    assert np.array_equal(chosen.samples.ids, reference.samples.ids)
    with pytest.raises(ConfigError, match=r"data.split: .*dict has the splits train, test, not 'validation'"):
        dataset.tokenize_source(
            tokenizer, DataSource(str(split_dir), split="validation"), max_length=256, overlong="drop"
        )


def test_a_csv_is_read_as_records_and_its_columns_mapped(tiny_model, tmp_path):  # noqa: F811
    qa = records_file(tmp_path / "qa.csv", QA)
    # Columns that are no format's: refused with the fields, the mapping and the key to set.
    with pytest.raises(ConfigError) as refused:
        prepare(tiny_model, f"data.path={qa}")
    assert str(refused.value).startswith(f"data.format: cannot tell the format of {qa} record 0 (fields: ")
    assert "answer, question" in str(refused.value)
    assert "map your field names with data.columns (e.g. {prompt: question, completion: answer})" in str(
        refused.value
    )
    mapped = prepare(tiny_model, f"data.path={qa}", "data.columns={prompt: question, completion: answer}")
    assert mapped.facts["format"] == "prompt_completion" and len(mapped.train) == 10
    # Only the answer is trained: the question's tokens carry no loss.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    ids, labels = mapped.train.sample(3)
    assert tokenizer.decode(ids[labels != -100]) == "3 times 2 is 6.<|endoftext|>"
    with pytest.raises(
        ConfigError, match=r"data.columns: .*qa.csv has no column 'reply' to read as 'completion'"
    ):
        prepare(tiny_model, f"data.path={qa}", "data.columns={prompt: question, completion: reply}")


def test_several_datasets_mix_by_weight(tiny_model, tmp_path):  # noqa: F811
    alpaca = records_file(tmp_path / "alpaca.parquet", ALPACA)
    qa = records_file(tmp_path / "qa.jsonl", QA)
    entries = (
        f"[{{path: {alpaca}, weight: 2}}, "
        f"{{path: {qa}, weight: 0.5, columns: {{prompt: question, completion: answer}}}}]"
    )
    mixed = prepare(tiny_model, f"data.datasets={entries}")
    assert len(mixed.train) == 12 * 2 + 5
    assert mixed.facts["format"] == "alpaca, prompt_completion"
    assert [(d["path"], d["samples"]) for d in mixed.facts["datasets"]] == [(alpaca, 24), (qa, 5)]
    assert f"data mix: 2 datasets, 29 samples: {alpaca} 24 (83%), {qa} 5 (17%)" in mixed.notes
    again = prepare(tiny_model, f"data.datasets={entries}")
    assert np.array_equal(mixed.train.ids, again.train.ids)  # the half drawn is the same on every rank
    other_seed = prepare(tiny_model, f"data.datasets={entries}", "train.seed=7")
    assert not np.array_equal(mixed.train.ids, other_seed.train.ids)


def test_the_bundled_text_and_plain_text_files_stay_text(tokenizer, tmp_path):
    bundled = tokenize(tokenizer, "")
    assert bundled.data_format == "text" and len(bundled.samples) > 100
    assert (bundled.samples.labels == bundled.samples.ids).all()  # every token trained
    notes = tmp_path / "notes.txt"
    notes.write_text("A plain text file. " * 200)
    assert tokenize(tokenizer, str(notes)).data_format == "text"
    with pytest.raises(ConfigError, match=r"data.format: is alpaca, but .*notes.txt is plain text"):
        dataset.tokenize(tokenizer, str(notes), data_format="alpaca", max_length=256, overlong="drop")


REFUSED = {
    "missing": ("missing.jsonl", None, "data.path: no such file or directory: {path}"),
    "binary with an unknown suffix": (
        "table.xlsx",
        b"PK\x03\x04\x14\x00\x06\x00\x08\x00\x00\x00!\x00\xff\xfe\x00\x81",
        "data.path: {path}: cannot tell what kind of data a .xlsx file is; give it the suffix of what it",
    ),
    "broken JSON lines": (
        "broken.jsonl",
        b'{"text": "a"}\n{"text": "b"\n',
        "data.path: {path}:2:13: a comma is missing between two values; fix or drop the line",
    ),
    "a directory of nothing readable": (
        "empty-dir",
        "dir",
        "data.path: cannot read {path} as a directory of",
    ),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_what_cannot_be_read_is_refused_by_name(case, tokenizer, tmp_path):
    name, content, expected = REFUSED[case]
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
        (path / "README").write_text("nothing to train on")
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError) as refused:
        tokenize(tokenizer, str(path))
    assert str(refused.value).startswith(expected.format(path=path)), str(refused.value)


def test_a_hub_dataset_id_without_a_reachable_hub_says_how_to_bring_it(tiny_model, tmp_path):  # noqa: F811
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--dry-run", "--set", f"model.name_or_path={tiny_model}",
         "--set", "data.path=someorg/some-data", "--set", f"output_dir={tmp_path / 'out'}"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == exitcodes.CONFIG_ERROR, done.stderr[-2000:]
    assert (
        "data.path: 'someorg/some-data' is not a local file or directory, and loading it as a hub dataset id "
        "failed" in done.stderr
    )
    assert "huggingface-cli download --repo-type dataset someorg/some-data --local-dir DIR" in done.stderr


CONFIG_REFUSED = {
    "path and datasets": (
        ["data.path=a.jsonl", "data.datasets=[{path: b.jsonl}]"],
        "data.path: and data.datasets are both set; use data.path (with data.columns/data.split) for one",
    ),
    "axolotl's type": (
        ["data.datasets=[{path: b.jsonl, type: alpaca}]"],
        "data.datasets[0].type: unknown key; type is format here",
    ),
    "weight zero": (
        ["data.datasets=[{path: b.jsonl, weight: 0}]"],
        "data.datasets[0].weight: must be a number",
    ),
    "unknown template": (["data.chat_template=vicuna"], "data.chat_template: 'vicuna' is neither a named"),
}


@pytest.mark.parametrize("case", CONFIG_REFUSED, ids=list(CONFIG_REFUSED))
def test_data_settings_are_checked_before_anything_starts(case, tiny_model, tmp_path, capsys):  # noqa: F811
    overrides, expected = CONFIG_REFUSED[case]
    good = records_file(tmp_path / "good.jsonl", ALPACA)
    sets = [f"model.name_or_path={tiny_model}", f"data.path={good}", f"output_dir={tmp_path / 'out'}"]
    if any(o.startswith("data.datasets") for o in overrides) and case != "path and datasets":
        sets[1] = "data.path="
    sets += overrides
    code = main(["train", "--dry-run", *[a for s in sets for a in ("--set", s)]])
    stderr = capsys.readouterr().err
    assert code == exitcodes.CONFIG_ERROR, stderr
    assert f"trainer: config error: {expected}" in stderr
    assert "secret@bucket" not in stderr  # the refusal does not echo the credential


def test_a_credential_in_an_s3_path_is_refused_in_a_file_and_a_set(tiny_model, tmp_path, capsys):  # noqa: F811
    config = tmp_path / "s3.yaml"
    config.write_text(
        f"model:\n  name_or_path: {tiny_model}\ndata:\n  path: s3://AKIA:secret@bucket/train.jsonl\n"
    )
    assert main(["train", "--dry-run", str(config)]) == exitcodes.CONFIG_ERROR
    stderr = capsys.readouterr().err
    assert (
        "trainer: config error: data.path: holds a credential (user:secret@ or a token parameter)" in stderr
    )
    assert "secret@bucket" not in stderr  # the refusal does not echo the credential
    sets = ["--set", "data.path=s3://AKIA:secret@bucket/train.jsonl"]
    assert main(["train", "--dry-run", str(config), *sets]) == exitcodes.CONFIG_ERROR
    stderr = capsys.readouterr().err
    assert "--set data.path=...: a URL with a credential in it on the command line" in stderr
    assert "secret@bucket" not in stderr


def test_the_fingerprint_and_identity_follow_the_content(tiny_model, tmp_path):  # noqa: F811
    data = tmp_path / "a.jsonl"
    records_file(data, ALPACA)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    base = [f"model.name_or_path={tiny_model}", f"data.path={data}"]
    first = data_fingerprint(load_config(None, base))
    assert first == data_fingerprint(load_config(None, base))
    assert first["sources"][0]["content"] == {"sha256": file_hash(data)}
    # One file's identity is its hash, as checkpoints written before several sources existed recorded.
    assert data_identity(load_config(None, base).data) == {"path": str(data), "sha256": file_hash(data)}
    for change in (
        "data.format=alpaca",
        "data.train_on_inputs=true",
        f"data.chat_template={template}",
        "data.columns={text: output}",
        "model.max_length=64",
    ):
        assert data_fingerprint(load_config(None, [*base, change])) != first, change
    with_template = data_fingerprint(load_config(None, [*base, f"data.chat_template={template}"]))
    template.write_text("{% for m in messages %}{{ m['role'] }}{% endfor %}")
    assert data_fingerprint(load_config(None, [*base, f"data.chat_template={template}"])) != with_template
    saved = tmp_path / "saved"
    records_file(saved, ALPACA)
    several = load_config(None, [f"model.name_or_path={tiny_model}", f"data.datasets=[{{path: {data}}}, "
                                 f"{{path: {saved}, weight: 2}}]"])  # fmt: skip
    identity = data_identity(several.data)
    assert identity["path"] == f"{data} + {saved}"
    data.write_text(data.read_text() + json.dumps({"instruction": "x", "output": "y"}) + "\n")
    assert data_fingerprint(load_config(None, base)) != first
    assert data_identity(several.data)["sha256"] != identity["sha256"]
