"""Chats to training samples: the chat template renders them, only assistant tokens carry loss (labels
-100 everywhere else). The record shapes are read into role/content messages by trainer.node.hf.formats,
the template chosen by trainer.node.hf.templates.

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
from trainer.node.hf.templates import CHATML_TEMPLATE, apply_template

__all__ = ["CHATML_TEMPLATE", "IGNORE", "assistant_labels", "ensure_chat_template", "render"]

IGNORE = -100


def ensure_chat_template(tokenizer: Any) -> str | None:
    """The tokenizer's own template, or ChatML where it has none (data.chat_template: tokenizer)."""
    return apply_template(tokenizer, "tokenizer")


def render(
    tokenizer: Any, messages: list[dict[str, Any]], where: str, key: str = "data.path"
) -> tuple[str, list[tuple[int, int]]]:
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
                key,
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
