#!/usr/bin/env python3
"""Build a tiny Hugging Face causal LM and chat data offline: what the fine-tuning tests, the benchmark
and a first try on a cluster train on, with no hub.

    build_tiny_hf_model.py model OUT_DIR [--hidden 64 --layers 2 --vocab 1024] [--no-chat-template]
                                         [--without-chatml-tokens]
    build_tiny_hf_model.py model OUT_DIR --hidden 896 --layers 24 --heads 14 --kv-heads 2 \
        --intermediate 4864 --model-vocab 151936 --vocab 8192     # Qwen2-0.5B's shape, random weights
    build_tiny_hf_model.py data OUT_FILE [--format conversations|messages|text] [--samples 400]
                                         [--jsonl] [--seed 0]

`model`: a randomly initialized Qwen2 (hidden 64, 2 layers, about 140k parameters by default) saved
with `save_pretrained` as safetensors, and a byte-level BPE tokenizer trained with `tokenizers` on the
English text the standard library ships (`pydoc_data.topics`), with the ChatML tokens and chat
template of Qwen's instruct models. `--no-chat-template` leaves the template out (the trainer then
uses ChatML); `--without-chatml-tokens` also leaves out <|im_start|>/<|im_end|> (a tokenizer the
trainer must refuse for conversations).

`data`: conversations about the same text (what is topic X about; small sums; some with a system
message, some two-turn) in the Qwen guide's `conversations` format, TRL's `messages` format or as
plain `text` records; a JSON list, or JSON lines with `--jsonl`. Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# The same template the trainer falls back to: one source of truth for ChatML.
from trainer.node.hf.chat import CHATML_TEMPLATE  # noqa: E402

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def corpus() -> list[str]:
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


def build_tokenizer(vocab_size: int, *, chat_template: bool, chatml_tokens: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = SPECIAL_TOKENS if chatml_tokens else SPECIAL_TOKENS[:1]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=special[1:],
    )
    if chat_template and chatml_tokens:
        wrapped.chat_template = CHATML_TEMPLATE
    return wrapped


def build_model(
    out: Path,
    *,
    hidden: int,
    layers: int,
    vocab: int,
    chat_template: bool,
    chatml_tokens: bool,
    heads: int = 0,
    kv_heads: int = 0,
    intermediate: int = 0,
    model_vocab: int = 0,
):
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(vocab, chat_template=chat_template, chatml_tokens=chatml_tokens)
    eos = [
        tokenizer.convert_tokens_to_ids(t)
        for t in ("<|im_end|>", "<|endoftext|>")
        if t in tokenizer.get_vocab()
    ]
    heads = heads or max(1, hidden // 16)
    config = Qwen2Config(
        # Embedding rows may exceed the tokenizer's vocabulary, as in Qwen's own checkpoints.
        vocab_size=max(model_vocab, len(tokenizer)),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or max(1, heads // 2),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos[-1],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=False, max_new_tokens=32
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():  # safetensors writes 0600; a model on a shared dir is read by other users
        path.chmod(0o644)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"{out}: Qwen2, hidden {hidden}, {layers} layers, vocab {len(tokenizer)}, {parameters:,} parameters"
    )


def _first_sentence(text: str, words: int = 24) -> str:
    """The first sentence of a topic's prose (its title, rules, grammar and code skipped)."""
    for paragraph in text.split("\n\n")[1:]:
        if "::=" in paragraph or paragraph.startswith(" ") or len(paragraph) < 40 or "===" in paragraph:
            continue
        flat = re.sub(r"\s+", " ", paragraph).strip()
        return " ".join(re.split(r"(?<=[.:])\s", flat, maxsplit=1)[0].split()[:words])
    return " ".join(text.split()[:words])


def conversations(samples: int, seed: int) -> list[list[dict[str, str]]]:
    """Conversations as `[{"role", "content"}]`: questions about the bundled text and small sums."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    names = sorted(topics)
    result = []
    for index in range(samples):
        messages = []
        if index % 5 == 0:
            messages.append({"role": "system", "content": "You answer in one short sentence."})
        if index % 2 == 0:
            name = rng.choice(names)
            messages += [
                {"role": "user", "content": f"What does the Python reference say about {name}?"},
                {"role": "assistant", "content": f"About {name}: {_first_sentence(topics[name])}"},
            ]
        else:
            a, b = rng.randint(1, 50), rng.randint(1, 50)
            messages += [
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
            ]
        if index % 7 == 0:
            c = rng.randint(1, 9)
            messages += [
                {"role": "user", "content": f"And twice {c}?"},
                {"role": "assistant", "content": f"Twice {c} is {2 * c}."},
            ]
        result.append(messages)
    return result


def records(samples: int, seed: int, data_format: str) -> list[dict]:
    chats = conversations(samples, seed)
    if data_format == "messages":
        return [{"messages": chat} for chat in chats]
    if data_format == "text":
        return [{"text": " ".join(m["content"] for m in chat if m["role"] != "system")} for chat in chats]
    return [
        {"id": f"sample-{i}", "conversations": [{"from": m["role"], "value": m["content"]} for m in chat]}
        for i, chat in enumerate(chats)
    ]


def write_data(out: Path, *, data_format: str, samples: int, seed: int, jsonl: bool) -> None:
    rows = records(samples, seed, data_format)
    out.parent.mkdir(parents=True, exist_ok=True)
    if jsonl:
        out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        out.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{out}: {samples} {data_format} records")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    model = commands.add_parser("model", help="a tiny random-init Qwen2 with a locally trained tokenizer")
    model.add_argument("out", type=Path)
    model.add_argument("--hidden", type=int, default=64)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--vocab", type=int, default=1024, help="tokenizer vocabulary (BPE merges)")
    model.add_argument("--heads", type=int, default=0, help="attention heads (default hidden / 16)")
    model.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default heads / 2)")
    model.add_argument("--intermediate", type=int, default=0, help="MLP width (default 2 × hidden)")
    model.add_argument("--model-vocab", type=int, default=0, help="embedding rows (default: the tokenizer's)")
    model.add_argument("--no-chat-template", action="store_true")
    model.add_argument("--without-chatml-tokens", action="store_true")
    data = commands.add_parser("data", help="chat data about the bundled text")
    data.add_argument("out", type=Path)
    data.add_argument("--format", choices=("conversations", "messages", "text"), default="conversations")
    data.add_argument("--samples", type=int, default=400)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--jsonl", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "model":
        build_model(
            args.out,
            hidden=args.hidden,
            layers=args.layers,
            vocab=args.vocab,
            chat_template=not args.no_chat_template,
            chatml_tokens=not args.without_chatml_tokens,
            heads=args.heads,
            kv_heads=args.kv_heads,
            intermediate=args.intermediate,
            model_vocab=args.model_vocab,
        )
    else:
        write_data(args.out, data_format=args.format, samples=args.samples, seed=args.seed, jsonl=args.jsonl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
