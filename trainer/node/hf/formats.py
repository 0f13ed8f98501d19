"""The shapes of fine-tuning records (axolotl's, LLaMA-Factory's, TRL's, OpenAI's, the Qwen guide's), each
turned into one `Example`: a chat (messages), a prompt and its completion, or a text.

- `alpaca`: `{instruction, input, output, system?, history?}` -> [system], user (instruction, then
  input after a blank line), assistant (output); LLaMA-Factory's `history` pairs come first;
- `sharegpt` (also `conversations`): `{conversations: [{from, value}], system?}` with human/gpt (and
  LLaMA-Factory's function_call/observation), or role/content turns inside `conversations`;
- `messages`: `{messages: [{role, content}]}`, content a string or a list of text parts
  `[{type: text, text}]`; `tool` messages are context, an assistant's `tool_calls` pass to a template
  that renders them;
- `prompt_completion` (TRL): `{prompt, completion}` as strings (the completion trained), or the prompt
  as a list of messages and the completion as a message list or a string (a chat);
- `text`: `{text}`, every token trained.

`auto` picks the format from the first record's fields. Every error names the source, the record,
the field and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainer.configerror import ConfigError

ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "human": "user",
    "gpt": "assistant",
    "function_call": "assistant",
    "observation": "tool",
}
ROLE_NAMES = "system, user, assistant, tool (human/gpt are user/assistant, observation is tool)"


@dataclass(frozen=True)
class DataFormat:
    """One shape of record: the registry below (FORMATS) is the one list of them; data.format's config
    type, data_keys' checks and docs/data.md follow it (tests/unit/node/test_data_formats.py)."""

    name: str
    """What data.format (and a data.datasets entry's format) takes."""
    fields: tuple[str, ...]
    """The fields that make it: `auto` picks the first format, in the registry's order, whose fields a
    record has all of."""
    shape: str
    """How its fields are described in a fix ("records have instruction/input/output")."""
    read: Callable[[dict, str, str], Example]
    """record, where, key -> its Example (ConfigError naming the field and the fix)."""
    aliases: tuple[str, ...] = ()
    """Other names data.format takes for it (the Qwen guide's `conversations`)."""


@dataclass(frozen=True)
class Example:
    """One record, ready to tokenize: `messages` (a chat), or `text` with the characters before
    `prompt_chars` as context (a prompt) and the rest trained."""

    messages: list[dict[str, Any]] | None = None
    text: str | None = None
    prompt_chars: int = 0


def canonical(data_format: str) -> str:
    return ALIASES.get(data_format, data_format)


def names() -> tuple[str, ...]:
    """Every name data.format takes: `auto`, then each format's name and aliases, in registry order."""
    return ("auto", *(name for f in FORMATS.values() for name in (f.name, *f.aliases)))


def looks_like(record: Any) -> str | None:
    """The format whose fields a record has, or None."""
    if isinstance(record, dict):
        for data_format in FORMATS.values():
            if all(record.get(f) is not None for f in data_format.fields):
                return data_format.name
    return None


def detect(record: Any, configured: str, where: str, key: str) -> tuple[str, str | None]:
    """(format, a log line saying what auto chose or None) for a source whose first record is `record`;
    key is the source's (`data.path`), whose section holds its format and columns."""
    section = key.rsplit(".", 1)[0]
    if configured != "auto":
        return canonical(configured), None
    found = looks_like(record)
    if found is None:
        fields = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(
            f"{section}.format",
            f"cannot tell the format of {where} (fields: {fields}); records need "
            f"{', '.join(f'{f.shape} ({f.name})' for f in FORMATS.values())}: map your field names with "
            f"{section}.columns (e.g. {{prompt: question, completion: answer}}) and set {section}.format",
        )
    return found, f"format auto -> {found} (records have {FORMATS[found].shape})"


def to_example(record: Any, data_format: str, where: str, key: str) -> Example:
    """The Example of one record in data_format; ConfigError naming where, the field and the fix."""
    if not isinstance(record, dict):
        raise ConfigError(key, f"{where}: a record must be a mapping of fields (got {type(record).__name__})")
    spec = FORMATS[data_format]
    missing = [f for f in spec.fields if record.get(f) is None]
    if missing:
        raise _missing(record, data_format, where, key, missing[0])
    return spec.read(record, where, key)


def _missing(record: dict, data_format: str, where: str, key: str, field: str) -> ConfigError:
    section = key.rsplit(".", 1)[0]
    other = looks_like(record)
    if other and other != data_format:
        fix = f"records have {FORMATS[other].shape}: set {section}.format: {other}"
    else:
        fix = (
            f"map the field that holds it with {section}.columns (e.g. {{{field}: your_name}}), or set "
            f"{section}.format to the records' format"
        )
    present = ", ".join(sorted(k for k, v in record.items() if v is not None))
    return ConfigError(
        f"{section}.format",
        f"{where}: no field `{field}` ({section}.format={data_format}; the record has {present}); {fix}",
    )


def _string(value: Any, where: str, field: str, key: str, *, empty_ok: bool = True) -> str:
    if value is None and empty_ok:
        return ""
    if not isinstance(value, str) or (not empty_ok and not value):
        raise ConfigError(
            key, f"{where}: {field} must be {'a' if empty_ok else 'a non-empty'} string (got {value!r})"
        )
    return value


def _alpaca(record: dict, where: str, key: str) -> Example:
    instruction = _string(record["instruction"], where, "instruction", key, empty_ok=False)
    extra = _string(record.get("input"), where, "input", key)
    output = _string(record["output"], where, "output", key)
    messages = []
    if record.get("system"):
        messages.append({"role": "system", "content": _string(record["system"], where, "system", key)})
    for number, pair in enumerate(record.get("history") or []):
        if not (isinstance(pair, list | tuple) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise ConfigError(
                key, f"{where}: history[{number}] must be a [question, answer] pair of strings (got {pair!r})"
            )
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    prompt = f"{instruction}\n\n{extra}" if extra else instruction
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    return Example(messages=messages)


def _sharegpt(record: dict, where: str, key: str) -> Example:
    messages = _turns(record, "conversations", where, key)
    if record.get("system") and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": _string(record["system"], where, "system", key)})
    return Example(messages=_with_reply(messages, where, key))


def _messages(record: dict, where: str, key: str) -> Example:
    return Example(messages=_with_reply(_turns(record, "messages", where, key), where, key))


def _turns(record: dict, field: str, where: str, key: str) -> list[dict[str, Any]]:
    """Turns as role/content messages; each turn may be from/value (ShareGPT) or role/content."""
    turns = record.get(field)
    if not isinstance(turns, list) or not turns:
        raise ConfigError(
            key,
            f"{where}: `{field}` must be a non-empty list of turns, each {{from, value}} or "
            f"{{role, content}} (got {turns!r:.80})",
        )
    messages = []
    for number, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ConfigError(key, f"{where}: {field}[{number}] must be a mapping (got {turn!r:.80})")
        role_key, content_key = ("from", "value") if turn.get("from") is not None else ("role", "content")
        role = turn.get(role_key)
        if role not in ROLES:
            raise ConfigError(
                key,
                f"{where}: {field}[{number}].{role_key} is {role!r}, an unknown role; "
                f"use one of {ROLE_NAMES}",
            )
        message: dict[str, Any] = {"role": ROLES[role]}
        message["content"] = _content(turn.get(content_key), where, f"{field}[{number}].{content_key}", key)
        if turn.get("tool_calls"):
            message["tool_calls"] = turn["tool_calls"]
        elif message["content"] is None:
            raise ConfigError(
                key, f"{where}: {field}[{number}].{content_key} is missing; give the turn's text"
            )
        for extra in ("name", "tool_call_id"):
            if turn.get(extra) is not None:
                message[extra] = turn[extra]
        messages.append(message)
    return messages


def _content(value: Any, where: str, field: str, key: str) -> str | None:
    """A message's text: a string, or OpenAI's list of parts of which only text parts are accepted."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for number, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ConfigError(
                    key,
                    f"{where}: {field}[{number}] is a {kind or type(part).__name__!r} part; only text parts "
                    "({type: text, text: ...}) can be trained on: remove the other parts or the record",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise ConfigError(key, f"{where}: {field} must be a string or a list of text parts (got {value!r:.80})")


def _with_reply(messages: list[dict[str, Any]], where: str, key: str) -> list[dict[str, Any]]:
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(
            key,
            f"{where}: the conversation has no assistant turn, so nothing in it would be trained on; "
            "add the assistant's reply or remove the record",
        )
    return messages


def _prompt_completion(record: dict, where: str, key: str) -> Example:
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return Example(text=prompt + completion, prompt_chars=len(prompt))
    if isinstance(prompt, list):
        messages = _turns({"prompt": prompt}, "prompt", where, key)
        if isinstance(completion, str):
            reply = [{"role": "assistant", "content": completion}]
        else:
            reply = _turns({"completion": completion}, "completion", where, key)
        return Example(messages=_with_reply(messages + reply, where, key))
    raise ConfigError(
        key,
        f"{where}: prompt must be a string or a list of messages, and completion a string or a list of "
        f"messages (got prompt {type(prompt).__name__}, completion {type(completion).__name__})",
    )


def _text(record: dict, where: str, key: str) -> Example:
    return Example(text=_string(record["text"], where, "text", key, empty_ok=False))


#: Every format, in the order `auto` tries them (the one list: see DataFormat).
FORMATS: dict[str, DataFormat] = {
    f.name: f
    for f in (
        DataFormat("messages", ("messages",), "messages (role/content)", _messages),
        DataFormat(
            "sharegpt",
            ("conversations",),
            "conversations (from/value)",
            _sharegpt,
            aliases=("conversations",),
        ),
        DataFormat("alpaca", ("instruction", "output"), "instruction/input/output", _alpaca),
        DataFormat("prompt_completion", ("prompt", "completion"), "prompt/completion", _prompt_completion),
        DataFormat("text", ("text",), "text", _text),
    )
}
#: Another name -> the format's own.
ALIASES = {alias: f.name for f in FORMATS.values() for alias in f.aliases}
