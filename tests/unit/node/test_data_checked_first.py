"""What is checked before the first step, so that nothing trains the wrong thing with exit 0: the eval
split drawn per dataset before weighting (no sample in both halves), model.max_length within the
model's positions, a broken data file named at FILE:LINE:COL with the fix, and one rendered sample
with its mask shown on request (`trainer train --dry-run --show-sample N`).

The tokenizer and model are the tiny ones scripts/build_tiny_hf_model.py builds offline (2048
positions).
"""

from __future__ import annotations

import json

import pytest
from helpers.finetune_harness import hf_cache, records_file, tiny_model  # noqa: F401

from trainer import exitcodes
from trainer.cli import main
from trainer.configerror import ConfigError
from trainer.node.config import load_config
from trainer.node.hf.sources import DataSource, read
from trainer.node.hf.training_data import build_training_data

ALPACA = [
    {"instruction": f"Name the number after {i}.", "input": "", "output": f"It is {i + 1}."}
    for i in range(40)
]
QA = [{"prompt": f"Q: what is {i} times 3?\nA:", "completion": f" {3 * i}."} for i in range(20)]


def prepare(tiny_model, *sets: str):  # noqa: F811
    from transformers import AutoTokenizer

    config = load_config(None, [f"model.name_or_path={tiny_model}", "model.max_length=128", *sets])
    return build_training_data(config, AutoTokenizer.from_pretrained(tiny_model))


def contents(samples) -> set[tuple[int, ...]]:
    return {tuple(samples.sample(i)[0].tolist()) for i in range(len(samples))}


def test_a_weighted_mixture_keeps_its_eval_samples_out_of_training(tiny_model, tmp_path):  # noqa: F811
    alpaca = records_file(tmp_path / "alpaca.jsonl", ALPACA + ALPACA[:3])  # 3 exact duplicates
    qa = records_file(tmp_path / "qa.jsonl", QA)
    data = prepare(
        tiny_model,
        f"data.datasets=[{{path: {alpaca}, weight: 2}}, {{path: {qa}}}]",
        "data.eval_fraction=0.1",
    )
    assert data.eval is not None
    # Drawn before weighting: no eval sample (by content) is also a training sample.
    assert contents(data.eval) & contents(data.train) == set()
    # Per dataset, from its distinct samples: 10% of alpaca's 40 and of qa's 20.
    assert len(data.eval) == 4 + 2
    # What is left trains at its weight: alpaca's 43 records less the 4 held out twice (no duplicate
    # was drawn with this seed), qa's 18 once.
    assert len(data.train) == (43 - 4) * 2 + 18
    log = "\n".join(data.notes)
    assert f"eval: 6 samples held out by data.eval_fraction=0.1: {alpaca} 4, {qa} 2" in log, log
    assert (
        f"{alpaca}: 43 alpaca records (weight 2) -> 78 samples and 4 held out for eval; 3 exact duplicates"
        in log
    ), log
    assert data.facts["eval_samples"] == 6 and data.facts["duplicates"] == 3


def test_max_length_beyond_the_models_positions_is_refused(tiny_model, tmp_path, capsys):  # noqa: F811
    data = records_file(tmp_path / "alpaca.jsonl", ALPACA)
    sets = ["--set", f"model.name_or_path={tiny_model}", "--set", f"data.path={data}"]
    assert main(["train", "--dry-run", *sets, "--set", "model.max_length=4096"]) == exitcodes.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "config error: model.max_length: 4096 tokens is more than the model's 2048 positions" in err, err
    assert "max_position_embeddings" in err
    assert main(["train", "--dry-run", *sets, "--set", "model.max_length=2048"]) == exitcodes.OK


def _lines(records: list[dict]) -> list[str]:
    return [json.dumps(record) for record in records]


BROKEN = {
    # A JSON lines file cut inside line 18 (a string left open).
    "cut.jsonl": (
        "\n".join([*_lines(ALPACA[:17]), _lines(ALPACA)[17][:25], *_lines(ALPACA[18:30])]) + "\n",
        "cut.jsonl:18:17: a string is not closed (the line may be cut short); fix or drop the line",
    ),
    # A JSON list with a missing colon on its 4th line.
    "list.json": (
        "[\n" + ",\n".join(_lines(ALPACA[:2])) + ',\n{"instruction": "x" "output": "y"}\n]\n',
        "list.json:4:21: a comma is missing between two values; fix the record",
    ),
    "empty.jsonl": ("", "empty.jsonl holds no records (the file is empty)"),
    "blank.jsonl": ("\n\n   \n", "blank.jsonl holds no records (only blank lines)"),
    "wrapped.json": (
        json.dumps({"data": ALPACA[:3]}),
        "wrapped.json is one JSON object whose field `data` holds 3 records; a .json file must be a "
        "list of records ([{...}, {...}]) or one record per line: write the list alone",
    ),
}


@pytest.mark.parametrize("name", BROKEN)
def test_a_broken_data_file_is_named_at_its_line_and_column(name, tmp_path):
    text, expected = BROKEN[name]
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        read(DataSource(str(path)))
    message = str(refused.value)
    assert message == f"data.path: {tmp_path}/{expected}", message


def test_a_broken_line_is_said_once_by_the_trainer(tiny_model, tmp_path, capfd):  # noqa: F811
    path = tmp_path / "cut.jsonl"
    path.write_text(BROKEN["cut.jsonl"][0])
    sets = ["--set", f"model.name_or_path={tiny_model}", "--set", f"data.path={path}"]
    assert main(["train", "--dry-run", *sets]) == exitcodes.CONFIG_ERROR
    captured = capfd.readouterr()
    assert (captured.out + captured.err).count("cut.jsonl:18") == 1, captured.err


def test_trainer_data_shows_a_rendered_sample_and_what_is_trained(tiny_model, tmp_path, capsys):  # noqa: F811
    data = records_file(tmp_path / "alpaca.jsonl", ALPACA)
    sets = ["--set", f"model.name_or_path={tiny_model}", "--set", f"data.path={data}"]
    assert main(["data", "--show-sample", "3", *sets, "--set", "data.eval_fraction=0.1"]) == exitcodes.OK
    out = capsys.readouterr().out
    assert "# data: 36 training samples, " in out and " trained (" in out and "; 4 eval samples" in out, out
    shown = out.partition(f"# sample 3 of 36: {data} record ")[2]
    assert shown, out
    number = int(shown.split(" ", 1)[0])  # the 4th training sample, whichever record it is
    # The prompt is context, the reply is trained: each run marked where it starts.
    assert f"<|im_start|>user\nName the number after {number}.<|im_end|>" in shown.split("[trained]")[0]
    assert f"[trained]It is {number + 1}.<|im_end|>" in shown, shown
    assert main(["data", "--show-sample", "99", *sets]) == exitcodes.CONFIG_ERROR
    assert "--show-sample: 99 is not a training sample: there are 40 (0 to 39)" in capsys.readouterr().err


def test_a_dry_run_shows_a_sample_too(tiny_model, tmp_path, capsys):  # noqa: F811
    data = records_file(tmp_path / "alpaca.jsonl", ALPACA)
    sets = ["--set", f"model.name_or_path={tiny_model}", "--set", f"data.path={data}"]
    assert main(["train", "--dry-run", "--show-sample", "0", *sets]) == exitcodes.OK
    out = capsys.readouterr().out
    assert "# sample 0 of 40" in out and "[trained]It is 1.<|im_end|>" in out, out
    assert main(["train", "--dry-run", "--show-sample", "0"]) == exitcodes.CONFIG_ERROR
    assert "--show-sample: shows a fine-tune's samples" in capsys.readouterr().err
