"""data.chat_template: which Jinja template renders the chats. `tokenizer` keeps the tokenizer's own
(ChatML where it has none); `chatml` and `llama3` are bundled here; anything else is the path of a
Jinja file. The choice is set on the tokenizer, so the saved model (final/) chats the way it was trained.

A template must render each turn the same whatever follows it (trainer.node.hf.chat finds the replies
by rendering prefixes); the bundled ones do.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.configerror import ConfigError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Meta's Llama 3 instruct layout without its tool-calling branches; the BOS is written literally
# because the samples are tokenized without added special tokens.
LLAMA3_TEMPLATE = (
    "{{ '<|begin_of_text|>' }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
NAMED = {
    "chatml": (CHATML_TEMPLATE, ("<|im_start|>", "<|im_end|>")),
    "llama3": (
        LLAMA3_TEMPLATE,
        ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    ),
}


def apply_template(tokenizer: Any, setting: str = "tokenizer", key: str = "data.chat_template") -> str | None:
    """Set the chosen template on the tokenizer; a note for the log where it is not the tokenizer's own,
    ConfigError where the tokenizer lacks the template's special tokens or the file cannot be read."""
    if setting == "tokenizer":
        if getattr(tokenizer, "chat_template", None):
            return None
        _require_tokens(tokenizer, "chatml", "model.name_or_path", fallback=True)
        tokenizer.chat_template = CHATML_TEMPLATE
        return "the tokenizer has no chat template: conversations are rendered as ChatML"
    if setting in NAMED:
        _require_tokens(tokenizer, setting, key)
        tokenizer.chat_template = NAMED[setting][0]
        return f"chat template: {setting} (data.chat_template)"
    path = Path(setting).expanduser()
    if not path.is_file():
        raise ConfigError(
            key,
            f"{setting!r} is neither a named template ({', '.join(['tokenizer', *NAMED])}) nor a Jinja file: "
            f"no such file {path}",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(key, f"cannot read the template {path}: {err}") from None
    tokenizer.chat_template = text
    return f"chat template: {path} (data.chat_template)"


def _require_tokens(tokenizer: Any, name: str, key: str, *, fallback: bool = False) -> None:
    tokens = NAMED[name][1]
    missing = [token for token in tokens if token not in tokenizer.get_vocab()]
    if not missing:
        return
    if fallback:
        raise ConfigError(
            key,
            f"the tokenizer has no chat template, and the ChatML template used then needs the tokens "
            f"{', '.join(tokens)}, which it lacks ({', '.join(missing)}); use a tokenizer with a chat "
            "template (an instruct/chat model's), set data.chat_template to a Jinja file for this "
            "tokenizer, or train on plain text with data.format=text",
        )
    raise ConfigError(
        key,
        f"{name} needs the tokens {', '.join(tokens)}, which this tokenizer lacks ({', '.join(missing)}); "
        "use the template of the model's family (data.chat_template: tokenizer, or a Jinja file)",
    )


def renders_tool_calls(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    # A tokenizer may hold several named templates (a dict); any of them may be the one used.
    return "tool_calls" in (" ".join(template.values()) if isinstance(template, dict) else template)
