"""Conversations to training samples: the tokenizer's chat template renders them, only assistant tokens
carry loss (labels -100 everywhere else).

Two input shapes, both normalized to `[{"role", "content"}]`:
- `conversations` (the Qwen guide's): `{"id", "conversations": [{"from": "user", "value": "..."}]}`;
  ShareGPT's `human`/`gpt` are read as `user`/`assistant`;
- `messages` (TRL's, OpenAI's): `{"messages": [{"role": "user", "content": "..."}]}`.

Which tokens are the assistant's: for the i-th assistant message, the template rendered up to the
message before it with the generation prompt is a text prefix P, rendered up to and including it is a
longer prefix F; the characters between P and F (the reply and the end-of-turn marker, e.g.
`<|im_end|>`) are the reply. The whole conversation is tokenized once with offsets, and a token is a
label when it starts inside a reply. This works for any template that renders earlier turns the
same way whatever follows them (ChatML, Llama, Mistral...), without `{% generation %}` markers.
"""

from __future__ import annotations

from typing import Any

from trainer.configerror import ConfigError

#: Used when the tokenizer has no chat template of its own (needs <|im_start|> and <|im_end|> tokens).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}
IGNORE = -100


def normalize(record: Any, data_format: str, where: str) -> list[dict[str, str]]:
    """`[{"role", "content"}]` from one record; ConfigError (key data.path) saying what is wrong where."""
    field, role_key, content_key = (
        ("conversations", "from", "value")
        if data_format == "conversations"
        else ("messages", "role", "content")
    )
    turns = record.get(field) if isinstance(record, dict) else None
    if not isinstance(turns, list) or not turns:
        raise ConfigError(
            "data.path",
            f"{where}: expected a non-empty list `{field}` (data.format={data_format}); "
            f"each record is {{{field!r}: [{{{role_key!r}: ..., {content_key!r}: ...}}, ...]}}",
        )
    messages = []
    for number, turn in enumerate(turns):
        role = turn.get(role_key) if isinstance(turn, dict) else None
        content = turn.get(content_key) if isinstance(turn, dict) else None
        if role not in ROLES:
            raise ConfigError(
                "data.path",
                f"{where}: {field}[{number}].{role_key} is {role!r}, an unknown role; "
                f"use one of {', '.join(ROLES)} (human/gpt are read as user/assistant)",
            )
        if not isinstance(content, str):
            raise ConfigError(
                "data.path", f"{where}: {field}[{number}].{content_key} must be a string (got {content!r})"
            )
        messages.append({"role": ROLES[role], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(
            "data.path",
            f"{where}: the conversation has no assistant turn, so nothing in it would be trained on; "
            "add the assistant's reply or remove the record",
        )
    return messages


def ensure_chat_template(tokenizer: Any) -> str | None:
    """Give a tokenizer without a chat template ChatML; a note for the log, or ConfigError if it lacks
    the tokens ChatML needs."""
    if getattr(tokenizer, "chat_template", None):
        return None
    vocab = tokenizer.get_vocab()
    missing = [token for token in CHATML_TOKENS if token not in vocab]
    if missing:
        raise ConfigError(
            "model.name_or_path",
            f"the tokenizer has no chat template, and the ChatML template used then needs the tokens "
            f"{', '.join(CHATML_TOKENS)}, which it lacks ({', '.join(missing)}); use a tokenizer with a chat "
            "template (an instruct/chat model's), or train on plain text with data.format=text",
        )
    tokenizer.chat_template = CHATML_TEMPLATE
    return "the tokenizer has no chat template: conversations are rendered as ChatML"


def render(tokenizer: Any, messages: list[dict[str, str]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of the assistant replies in it."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise ConfigError(
                "data.path",
                f"{where}: the chat template renders turn {index} differently depending on what follows it, "
                "so the assistant's tokens cannot be told apart (e.g. a template that rewrites earlier "
                "turns); use a template that renders each turn once, or data.format=text",
            )
        spans.append((len(before), len(through)))
    return text, spans


def assistant_labels(
    input_ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]
) -> list[int]:
    """input_ids where a token starts inside an assistant span, IGNORE elsewhere."""
    labels = []
    span_index = 0
    for token, (start, _end) in zip(input_ids, offsets, strict=True):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        inside = span_index < len(spans) and spans[span_index][0] <= start < spans[span_index][1]
        labels.append(token if inside else IGNORE)
    return labels
