"""`trainer data [CONFIG] [--set ...] [--show-sample N]`: what a fine-tune would train on, checked and
shown before anything starts (axolotl's `preprocess --debug`): the config, the model's config and
tokenizer (no weights), every source read, tokenized, split and mixed as `trainer train` does it,
then the log's data lines and, with --show-sample, sample N rendered with the chat template and each
run of tokens marked [context] (no loss) or [trained]. Nothing is written.
"""

from __future__ import annotations

import argparse
import sys

from trainer import exitcodes
from trainer.configerror import ConfigError
from trainer.node.data import DataError

EXAMPLES = (
    "trainer data finetune-lora.yaml --show-sample 0  # the first sample as the model sees it, loss marked",
    "trainer data --set model.name_or_path=/srv/models/qwen --set data.path=chats.jsonl --show-sample 12",
)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "config_file", nargs="?", metavar="CONFIG", help="YAML config, as trainer train takes it"
    )
    parser.add_argument("--config", metavar="FILE", help="YAML config (as CONFIG)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, as with trainer train (repeatable)",
    )
    parser.add_argument(
        "--show-sample",
        type=int,
        metavar="N",
        action="append",
        default=[],
        help="print training sample N (0-based, in the order prepared) rendered with the chat template, "
        "each run of tokens marked [context] (no loss) or [trained] (repeatable)",
    )


def run(args: argparse.Namespace) -> int:
    from trainer.node.config import load_config
    from trainer.node.train import config_path

    try:
        config = load_config(config_path(args), args.overrides)
        if not config.model.name_or_path:
            raise ConfigError(
                "model.name_or_path",
                "trainer data shows a Hugging Face model's samples; set model.name_or_path (the built-in "
                "tiny GPT trains on plain text cut into data.block_size pieces)",
            )
        from transformers.utils import logging as transformers_logging

        from trainer.node.hf.model import check_source, load_model_config, load_tokenizer
        from trainer.node.hf.training_data import build_training_data, show_sample

        transformers_logging.disable_progress_bar()
        source = check_source(config.model.name_or_path)
        config.model.check_positions(load_model_config(config.model, source))
        tokenizer = load_tokenizer(config.model, source)
        data = build_training_data(config, tokenizer)
        for line in data.notes:
            print(f"# {line}")
        for index in args.show_sample:
            print(show_sample(data, tokenizer, index))
    except ConfigError as err:
        print(f"trainer: config error: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    except DataError as err:
        print(f"trainer: data error: {err}", file=sys.stderr)
        return exitcodes.DATA_ERROR
    return exitcodes.OK
