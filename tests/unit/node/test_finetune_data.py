"""Fine-tuning data: chats rendered with the chat template and only the assistant's tokens trained on,
over-long samples, packing, and every kind of bad input stopped before training with the key and fix.

The tokenizer and model are the tiny ones scripts/build_tiny_hf_model.py builds offline.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.finetune_harness import build, chat_data, hf_cache, tiny_model  # noqa: F401

from trainer import exitcodes
from trainer.cli import main
from trainer.node.config import load_config
from trainer.node.hf import dataset
from trainer.node.hf.batches import Collator, FinetuneBatches
from trainer.node.hf.chat import IGNORE, assistant_labels, render
from trainer.node.hf.formats import to_example
from trainer.node.hf.job import FineTune
from trainer.node.hf.packing import pack
from trainer.node.order import START

CHAT = {
    "id": "c1",
    "conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "user", "value": "What is 2 plus 2?"},
        {"from": "assistant", "value": "2 plus 2 is 4."},
        {"from": "human", "value": "And twice 3?"},
        {"from": "gpt", "value": "Twice 3 is 6."},
    ],
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):  # noqa: F811
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def write_json(path, records) -> str:
    path.write_text(json.dumps(records))
    return str(path)


def test_only_the_assistants_tokens_carry_labels(tokenizer):
    messages = to_example(CHAT, "sharegpt", "test", "data.path").messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    text, spans = render(tokenizer, messages, "test")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = assistant_labels(encoded["input_ids"], encoded["offset_mapping"], spans)
    trained = tokenizer.decode([t for t in labels if t != IGNORE])
    assert trained == "2 plus 2 is 4.<|im_end|>\nTwice 3 is 6.<|im_end|>\n"
    ignored = tokenizer.decode(
        [t for t, label in zip(encoded["input_ids"], labels, strict=True) if label == IGNORE]
    )
    # The system prompt, the user's questions and the turn headers are context only.
    for context in ("Be brief.", "What is 2 plus 2?", "And twice 3?", "<|im_start|>assistant\n"):
        assert context in ignored
    assert "is 4" not in ignored and "is 6" not in ignored


def test_messages_and_conversations_formats_give_the_same_samples(tokenizer, tmp_path):
    build("data", str(tmp_path / "c.jsonl"), "--samples", "30", "--jsonl")
    build("data", str(tmp_path / "m.json"), "--samples", "30", "--format", "messages")
    kwargs = {"data_format": "auto", "max_length": 512, "overlong": "truncate"}
    conversations = dataset.tokenize(tokenizer, str(tmp_path / "c.jsonl"), **kwargs)
    messages = dataset.tokenize(tokenizer, str(tmp_path / "m.json"), **kwargs)
    assert (conversations.data_format, messages.data_format) == ("sharegpt", "messages")
    assert len(conversations.samples) == 30
    assert np.array_equal(conversations.samples.ids, messages.samples.ids)
    assert np.array_equal(conversations.samples.labels, messages.samples.labels)


def test_a_tokenizer_without_chat_template_gets_chatml(hf_cache, tmp_path, tokenizer):  # noqa: F811
    model = hf_cache / "no-template"
    if not (model / "config.json").is_file():
        build("model", str(model), "--no-chat-template")
    data = write_json(tmp_path / "chat.json", [CHAT])
    config = load_config(None, [f"model.name_or_path={model}", f"data.path={data}"])
    job = FineTune.prepare(config, world_size=1)
    assert any("no chat template: conversations are rendered as ChatML" in note for note in job.notes)
    with_template = dataset.tokenize(tokenizer, data, data_format="auto", max_length=512, overlong="drop")
    assert np.array_equal(job.train.labels, with_template.samples.labels)


def test_overlong_samples_are_truncated_or_dropped_and_counted(tokenizer, chat_data):  # noqa: F811
    full = dataset.tokenize(tokenizer, str(chat_data), data_format="auto", max_length=4096, overlong="drop")
    longer = int((full.samples.lengths() > 48).sum())
    assert 0 < longer < len(full.samples)
    dropped = dataset.tokenize(tokenizer, str(chat_data), data_format="auto", max_length=48, overlong="drop")
    assert dropped.dropped_overlong == longer and len(dropped.samples) == len(full.samples) - longer
    cut = dataset.tokenize(tokenizer, str(chat_data), data_format="auto", max_length=48, overlong="truncate")
    assert cut.truncated == longer
    assert len(cut.samples) == len(full.samples) - cut.dropped_untrained
    assert cut.samples.lengths().max() <= 48
    line = cut.summary(str(chat_data), 48, "truncate")
    assert f"{longer} longer than model.max_length=48 truncated" in line
    assert "data.overlong=drop" in line  # the other way


def test_packed_rows_fit_and_attention_stays_within_each_sample(tokenizer, tiny_model, chat_data):  # noqa: F811
    from transformers import AutoModelForCausalLM

    samples = dataset.tokenize(
        tokenizer, str(chat_data), data_format="auto", max_length=128, overlong="truncate"
    ).samples
    rows = pack(samples.lengths(), 128)
    assert sorted(rows.members.tolist()) == list(range(len(samples)))  # every sample exactly once
    assert rows.totals(samples.lengths()).max() <= 128
    assert len(rows) <= 1.1 * samples.lengths().sum() / 128  # within 10% of no pad at all

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    collator = Collator(samples, rows, pad_id=tokenizer.pad_token_id, reset_positions=True, device="cpu")
    row = next(i for i in range(len(rows)) if len(rows.row(i)) >= 2)
    input_ids, labels, positions, _ = collator.collate([row], 1.0)
    first, second = (int(s) for s in rows.row(row)[:2])
    start, length = len(samples.sample(first)[0]), len(samples.sample(second)[0])
    assert labels[0, start] == IGNORE  # the second sample's first token is not predicted from the first
    with torch.no_grad():
        packed = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
        alone = model(input_ids=torch.as_tensor(samples.sample(second)[0][None], dtype=torch.long)).logits
    assert torch.allclose(packed[0, start : start + length], alone[0], atol=1e-4)


def test_the_loss_is_a_mean_over_every_label_token_of_the_step(tokenizer, chat_data):  # noqa: F811
    samples = dataset.tokenize(
        tokenizer, str(chat_data), data_format="auto", max_length=128, overlong="truncate"
    ).samples
    rows = pack(samples.lengths(), 128)
    world, accumulation = 2, 3
    collator = Collator(samples, rows, pad_id=0, reset_positions=True, device="cpu")
    ranks = [
        FinetuneBatches(collator, repeats=1, micro_batch_size=2, rank=r, world_size=world, seed=5)
        for r in range(world)
    ]
    for rank in ranks:
        rank.start(START, accumulation)
    # Each micro-batch's loss is a sum over its label tokens divided by num_items; the engines average
    # over micro-batches and ranks: together a plain mean over all label tokens of the step.
    weights = []
    for rank in ranks:
        for _, labels, _, num_items in rank.micro_batches(1):
            weights.append((labels[:, 1:] != IGNORE).sum().item() / num_items.item())
    assert sum(weights) == pytest.approx(world * accumulation)
    seen = [
        int(row)
        for rank in ranks
        for index in range(accumulation)
        for row in rank.micro_batch_samples(1, index, rank.rank)
    ]
    assert len(seen) == len(set(seen)) == world * accumulation * 2  # disjoint across ranks


BAD_INPUT = {
    "missing-model": (["model.name_or_path={tmp}/nowhere"], "model.name_or_path: no such directory"),
    "not-a-model": (
        ["model.name_or_path={tmp}"],
        "model.name_or_path: {tmp} is not a Hugging Face model directory: it has no config.json",
    ),
    "no-chatml-tokens": (
        ["model.name_or_path={bare}"],
        "model.name_or_path: the tokenizer has no chat template, and the ChatML template used then needs",
    ),
    "unknown-role": (
        ["data.path={bad_role}"],
        "data.path: {bad_role} record 0 (id 'x'): conversations[1].from is 'bot', an unknown role; "
        "use one of",
    ),
    "no-assistant": (
        ["data.path={no_reply}"],
        "data.path: {no_reply} record 0: the conversation has no assistant turn, so nothing in it would be "
        "trained on; add the assistant's reply or remove the record",
    ),
    "lora-targets": (
        ["lora.enabled=true", "lora.target_modules=q_proj,qkv_proj"],
        "lora.target_modules: 'qkv_proj' matches no module of the model",
    ),
    "qlora-on-cpu": (
        ["lora.enabled=true", "lora.qlora=true"],
        "lora.qlora: 4-bit quantization (bitsandbytes) runs on CUDA GPUs only and this node has none",
    ),
    "lora-without-model": (
        ["model.name_or_path=", "lora.enabled=true"],
        "lora.enabled: applies to Hugging Face models only",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUT, ids=list(BAD_INPUT))
def test_bad_input_stops_before_training_naming_the_key(case, tmp_path, tiny_model, hf_cache, capsys):  # noqa: F811
    bare = hf_cache / "bare-tokenizer"
    if case == "no-chatml-tokens" and not (bare / "config.json").is_file():
        build("model", str(bare), "--without-chatml-tokens")
    paths = {
        "tmp": tmp_path,
        "bare": bare,
        "bad_role": write_json(
            tmp_path / "role.json",
            [{"id": "x", "conversations": [{"from": "user", "value": "hi"}, {"from": "bot", "value": "yo"}]}],
        ),
        "no_reply": write_json(tmp_path / "noreply.json", [{"messages": [{"role": "user", "content": "?"}]}]),
    }
    overrides, expected = BAD_INPUT[case]
    good = write_json(tmp_path / "good.json", [CHAT] * 8)
    sets = [f"model.name_or_path={tiny_model}", f"data.path={good}", f"output_dir={tmp_path / 'out'}"]
    sets += [o.format(**paths) for o in overrides]
    code = main(["train", *[a for s in sets for a in ("--set", s)]])
    stderr = capsys.readouterr().err
    assert code == exitcodes.CONFIG_ERROR, stderr
    assert f"trainer: config error: {expected.format(**paths)}" in stderr
    assert not (tmp_path / "out").exists(), "nothing may start"


def test_dry_run_reports_the_data_before_anything_starts(tiny_model, chat_data, tmp_path, capsys):  # noqa: F811
    sets = [f"model.name_or_path={tiny_model}", f"data.path={chat_data}", "model.max_length=64",
            "data.packing=true", f"output_dir={tmp_path / 'out'}"]  # fmt: skip
    assert main(["train", "--dry-run", *[a for s in sets for a in ("--set", s)]]) == exitcodes.OK
    out = capsys.readouterr().out
    assert "# data: " in out and "400 sharegpt records" in out and "truncated" in out
    assert "# packing: " in out
    assert not (tmp_path / "out").exists()


def test_the_example_lora_config_checks_out_with_a_model_and_data(tiny_model, chat_data, tmp_path, capsys):  # noqa: F811
    example = "trainer/node/configs/finetune-lora.yaml"
    sets = [f"model.name_or_path={tiny_model}", f"data.path={chat_data}", f"output_dir={tmp_path / 'out'}"]
    assert main(["train", "--config", example, "--dry-run", *[a for s in sets for a in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert "engine: deepspeed" in out and "r: 64" in out and "# data: " in out
    # Without a model the example is refused, naming what to set.
    assert main(["train", "--config", example, "--set", f"output_dir={tmp_path / 'out'}"]) == 2
    assert "set model.name_or_path to a model directory" in capsys.readouterr().err


def test_warmup_ratio_replaces_warmup_steps():
    from trainer.node.optim import lr_multiplier

    config = load_config(
        None, ["train.max_steps=200", "train.warmup_ratio=0.05", "train.warmup_steps=3"]
    ).train
    assert config.warmup() == 10
    assert lr_multiplier(8, config) < lr_multiplier(9, config) < 1.0 == lr_multiplier(10, config)


def test_a_hub_id_without_a_reachable_hub_says_how_to_download_it(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--dry-run",
         "--set", "model.name_or_path=someorg/some-model"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == exitcodes.CONFIG_ERROR, done.stderr[-2000:]
    assert (
        "model.name_or_path: 'someorg/some-model' is not a local directory, and loading it as a hub id"
        in done.stderr
    )
    assert "huggingface-cli download someorg/some-model --local-dir DIR" in done.stderr


def test_an_eval_file_or_a_held_out_fraction(tiny_model, chat_data, tmp_path):  # noqa: F811
    base = [f"model.name_or_path={tiny_model}", f"data.path={chat_data}"]
    held_out = FineTune.prepare(load_config(None, [*base, "data.eval_fraction=0.1"]), world_size=2)
    # 10% of the distinct chats (the 400 repeat some: 84 are copies), every copy of an eval chat kept
    # out of training.
    assert held_out.facts["duplicates"] == 84
    assert (len(held_out.train), len(held_out.eval)) == (356, 32)
    again = FineTune.prepare(load_config(None, [*base, "data.eval_fraction=0.1"]), world_size=2)
    assert np.array_equal(held_out.eval.ids, again.eval.ids)  # the same on every rank and every run
    eval_file = write_json(tmp_path / "eval.json", [CHAT] * 5)
    separate = FineTune.prepare(load_config(None, [*base, f"data.eval_path={eval_file}"]), world_size=2)
    assert (len(separate.train), len(separate.eval)) == (400, 5)
    assert any(note.startswith(f"eval data: {eval_file}: 5 sharegpt records") for note in separate.notes)
