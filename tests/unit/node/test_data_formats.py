"""The record formats users bring (alpaca, sharegpt in both turn shapes, OpenAI messages with text parts
and tool turns, TRL's prompt/completion, text): which tokens each trains on, what `auto` chooses and
says, every format error naming the file, record, field and fix, and the chat template choice
(tokenizer, chatml, llama3, a Jinja file).

Records are written to real files by the tests; the tokenizers are the tiny one
scripts/build_tiny_hf_model.py builds offline and that one with Llama 3's special tokens added.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.finetune_harness import hf_cache, llama3_tokenizer, records_file, tiny_model  # noqa: F401

from trainer import exitcodes
from trainer.cli import main
from trainer.configerror import ConfigError
from trainer.node.hf import dataset
from trainer.node.hf.chat import IGNORE


@pytest.fixture
def tokenizer(tiny_model):  # noqa: F811
    # A fresh tokenizer per test: a chosen template is set on it.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def read(tokenizer, path: str, data_format: str = "auto", **settings) -> dataset.Tokenized:
    return dataset.tokenize(
        tokenizer, path, data_format=data_format, max_length=512, overlong="drop", **settings
    )


def trained(tokenizer, tokenized: dataset.Tokenized, index: int = 0) -> str:
    ids, labels = tokenized.samples.sample(index)
    return tokenizer.decode(ids[labels != IGNORE])


def test_alpaca_trains_the_output_only_unless_train_on_inputs(tokenizer, tmp_path):
    record = {
        "system": "Answer in one sentence.",
        "instruction": "Name the capital.",
        "input": "France",
        "output": "Paris is the capital of France.",
    }
    path = records_file(tmp_path / "alpaca.jsonl", [record])
    replies = read(tokenizer, path)
    assert (replies.data_format, replies.format_note) == (
        "alpaca",
        "format auto -> alpaca (records have instruction/input/output)",
    )
    assert trained(tokenizer, replies) == "Paris is the capital of France.<|im_end|>\n"
    ids, _ = replies.samples.sample(0)
    rendered = tokenizer.decode(ids)
    assert "<|im_start|>system\nAnswer in one sentence.<|im_end|>" in rendered
    assert "<|im_start|>user\nName the capital.\n\nFrance<|im_end|>" in rendered
    everything = read(tokenizer, path, train_on_inputs=True)
    assert np.array_equal(everything.samples.ids, replies.samples.ids)
    assert (everything.samples.labels == everything.samples.ids).all()


def test_sharegpt_turn_shapes_and_messages_parts_give_the_same_samples(tokenizer, tmp_path):
    from_value = {
        "conversations": [
            {"from": "human", "value": "What is 2 plus 2?"},
            {"from": "gpt", "value": "It is 4."},
        ],
        "system": "Be brief.",
    }
    role_content = {
        "conversations": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 plus 2?"},
            {"role": "assistant", "content": "It is 4."},
        ]
    }
    parts = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2 plus 2?"}],
            },
            {"role": "assistant", "content": "It is 4."},
        ]
    }
    first = read(tokenizer, records_file(tmp_path / "a.jsonl", [from_value]))
    assert first.data_format == "sharegpt"
    assert trained(tokenizer, first) == "It is 4.<|im_end|>\n"
    for name, record, data_format in (
        ("b.jsonl", role_content, "conversations"),  # the older name of the format
        ("c.json", parts, "auto"),
    ):
        other = read(tokenizer, records_file(tmp_path / name, [record]), data_format)
        assert np.array_equal(other.samples.ids, first.samples.ids), name
        assert np.array_equal(other.samples.labels, first.samples.labels), name


def test_tool_turns_are_context_and_unrendered_tool_calls_are_refused(tokenizer, tmp_path):
    with_tool = {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Let me look."},
            {"role": "tool", "content": "rain, 8 C"},
            {"role": "assistant", "content": "Rain and 8 degrees."},
        ]
    }
    tool = read(tokenizer, records_file(tmp_path / "tool.jsonl", [with_tool]))
    assert trained(tokenizer, tool) == "Let me look.<|im_end|>\nRain and 8 degrees.<|im_end|>\n"
    call = {
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
                ],
            },
            {"role": "tool", "content": "rain"},
            {"role": "assistant", "content": "Rain."},
        ]
    }
    path = records_file(tmp_path / "call.json", [call])
    with pytest.raises(ConfigError) as refused:
        read(tokenizer, path)
    assert str(refused.value).startswith(
        f"data.path: {path} record 0: message 1 has tool_calls, which the chat template does not render"
    )
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                          {"role": "assistant", "content": "A cat."}]}  # fmt: skip
    path = records_file(tmp_path / "image.json", [image])
    with pytest.raises(
        ConfigError, match=r"record 0: messages\[0\].content\[0\] is a 'image_url' part; only text"
    ):
        read(tokenizer, path)


def test_prompt_completion_trains_the_completion(tokenizer, tmp_path):
    plain = read(
        tokenizer, records_file(tmp_path / "pc.jsonl", [{"prompt": "The sky is", "completion": " blue."}])
    )
    assert plain.data_format == "prompt_completion"
    assert trained(tokenizer, plain) == " blue.<|endoftext|>"
    ids, _ = plain.samples.sample(0)
    assert tokenizer.decode(ids) == "The sky is blue.<|endoftext|>"
    chat = {"prompt": [{"role": "user", "content": "Colour of the sky?"}], "completion": "Blue."}
    conversational = read(tokenizer, records_file(tmp_path / "chat.jsonl", [chat]))
    assert trained(tokenizer, conversational) == "Blue.<|im_end|>\n"
    everything = read(tokenizer, str(tmp_path / "pc.jsonl"), train_on_inputs=True)
    assert trained(tokenizer, everything) == "The sky is blue.<|endoftext|>"


def test_text_records_train_every_token(tokenizer, tmp_path):
    text = read(tokenizer, records_file(tmp_path / "t.parquet", [{"text": "Plain words to learn."}]))
    assert text.data_format == "text"
    assert trained(tokenizer, text) == "Plain words to learn.<|endoftext|>"


FORMAT_ERRORS = {
    "alpaca read as messages": (
        "a.jsonl",
        [{"instruction": "Add 1 and 2.", "input": "", "output": "3"}],
        ["data.format=messages"],
        "data.format: {path} record 0: no field `messages` (data.format=messages; the record has "
        "input, instruction, output); records have instruction/input/output: set data.format: alpaca",
    ),
    "unknown role": (
        "r.json",
        [{"id": 7, "conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]}],
        [],
        "data.path: {path} record 0 (id 7): conversations[1].from is 'bot', an unknown role; use one of",
    ),
    "empty instruction": (
        "e.jsonl",
        [
            {"instruction": "Say y.", "input": "", "output": "y"},
            {"instruction": "", "input": "x", "output": "y"},
        ],
        ["data.format=alpaca"],
        "data.path: {path} record 1: instruction must be a non-empty string (got '')",
    ),
    "a later record of another shape": (
        "m.jsonl",
        [{"text": "fine"}, {"prompt": "no text here", "completion": "x"}],
        [],
        "data.format: {path} record 1: no field `text` (data.format=text; the record has completion, "
        "prompt); records have prompt/completion: set data.format: prompt_completion",
    ),
}


@pytest.mark.parametrize("case", FORMAT_ERRORS, ids=list(FORMAT_ERRORS))
def test_format_errors_name_the_file_record_field_and_fix(case, tiny_model, tmp_path, capsys):  # noqa: F811
    name, records, overrides, expected = FORMAT_ERRORS[case]
    path = tmp_path / name
    records_file(path, records)
    sets = [
        f"model.name_or_path={tiny_model}",
        f"data.path={path}",
        f"output_dir={tmp_path / 'out'}",
        *overrides,
    ]
    code = main(["train", "--dry-run", *[a for s in sets for a in ("--set", s)]])
    stderr = capsys.readouterr().err
    assert code == exitcodes.CONFIG_ERROR, stderr
    assert f"trainer: config error: {expected.format(path=path)}" in stderr


def test_a_named_template_or_a_jinja_file_renders_the_chats(tokenizer, llama3_tokenizer, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer

    chat = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}
    ]
    path = records_file(tmp_path / "chat.jsonl", chat)
    llama = AutoTokenizer.from_pretrained(llama3_tokenizer)
    rendered = read(llama, path, chat_template="llama3")
    assert rendered.template_note == "chat template: llama3 (data.chat_template)"
    assert llama.decode(rendered.samples.sample(0)[0]) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello there.<|eot_id|>"
    )
    assert trained(llama, rendered) == "Hello there.<|eot_id|>"
    # The tokenizer keeps the template: final/ is saved with it and chats as it was trained.
    assert "<|start_header_id|>" in llama.chat_template
    lacking = r"llama3 needs the tokens .*which this tokenizer lacks \(<\|begin_of_text\|>, <\|start_header"
    with pytest.raises(ConfigError, match=rf"data.chat_template: {lacking}"):
        read(tokenizer, path, chat_template="llama3")
    jinja = tmp_path / "plain.jinja"
    jinja.write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}### Question: {{ m['content'] }}\n"
        "{% else %}### Answer: {{ m['content'] }}<|endoftext|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}### Answer: {% endif %}"
    )
    custom = read(tokenizer, path, chat_template=str(jinja))
    assert tokenizer.decode(custom.samples.sample(0)[0]) == (
        "### Question: Hi\n### Answer: Hello there.<|endoftext|>\n"
    )
    assert trained(tokenizer, custom) == "Hello there.<|endoftext|>\n"


def test_the_formats_registry_is_the_one_list_the_config_checks_and_docs_follow():
    """A format added to trainer.node.hf.formats.FORMATS (or an alias) is a name data.format takes, a
    name the data.datasets check takes, and a format docs/data.md describes; none of them lists one
    the registry lacks."""
    import re
    import typing
    from dataclasses import fields
    from pathlib import Path

    from trainer.node.data import DataConfig
    from trainer.node.hf import data_keys, formats

    annotation = next(f.type for f in fields(DataConfig) if f.name == "format")
    literal = typing.get_args(eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation)
    assert literal == formats.names() == data_keys.FORMATS
    docs = (Path(__file__).resolve().parents[3] / "docs" / "data.md").read_text()
    section = docs.split("## Formats", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"^\*\*(\w+)\*\*", section, flags=re.MULTILINE)) == set(formats.FORMATS)
    for alias, name in formats.ALIASES.items():
        assert f"**{name}** (also accepted as `{alias}`" in section
