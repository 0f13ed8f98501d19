"""`trainer` command line: one verb per module, imported only when that verb runs.

`trainer plan` and `trainer preflight` run on a controller that has no torch; `trainer train` runs on
the nodes. Importing a verb's module only when it is asked for keeps each of them light.
Each verb module provides `configure_parser(parser)` and `run(args) -> int` (the exit code), and
`EXAMPLES`: a few command lines its --help ends with, as a user would type them.
A module with `TAKES_COMMAND = True` gets everything after the first `--` as `args.command`, as
given: the user's own command (its options are never read as ours).
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import textwrap
from types import ModuleType

from trainer import __version__, exitcodes, logsetup
from trainer.redaction import secret_set_problem

#: verb -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("trainer.node.train", "run one training worker (alone or under torchrun/deepspeed/accelerate)"),
    "data": (
        "trainer.node.hf.inspect_data",
        "check a fine-tune's data and show what it trains on: counts, tokens, a sample with its loss",
    ),
    "plan": ("trainer.controller.launcher.plan", "print the topology from an inventory; touches nothing"),
    "launch": (
        "trainer.controller.launcher.launch_cli",
        "start the trainer, or your own command, on every host of an inventory",
    ),
    "status": (
        "trainer.controller.launcher.status",
        "where a launch stands on every host: state, step, last log lines; changes nothing",
    ),
    "attach": (
        "trainer.controller.launcher.attach",
        "follow a running launch again (after its launcher died) to its end",
    ),
    "stop": ("trainer.controller.launcher.stop", "stop a run on every node of its last launch"),
    "logs": (
        "trainer.controller.launcher.logs",
        "print a run's node logs (every node, or one), and with -f follow them to the run's end",
    ),
    "sbatch": (
        "trainer.controller.launcher.sbatch",
        "write the same job as a Slurm (or PBS) batch script; contacts and starts nothing",
    ),
    "preflight": ("trainer.controller.preflight.cli", "check a cluster before launching and name the fixes"),
    "up": (
        "trainer.controller.up",
        "from bare hosts to training in one command: provision (site.yml), preflight's probe pass, launch",
    ),
    "export": (
        "trainer.node.hf.export",
        "a Hugging Face model directory from a fine-tuning run or checkpoint",
    ),
    "push": (
        "trainer.controller.push",
        "copy a model or dataset onto the cluster's shared dir (resumable, checked); prints its config path",
    ),
    "report": (
        "trainer.node.report",
        "draw a run's curves (loss, lr, tokens/s, step time) as PNG files and one page, report.html",
    ),
}


def _usage() -> str:
    lines = [f"usage: trainer {{{','.join(COMMANDS)}}} ...", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, help_text) in COMMANDS.items()]
    lines += ["", "run `trainer COMMAND --help` for the options of one command"]
    return "\n".join(lines)


def epilog_with_examples(epilog: str | None, examples: tuple[str, ...]) -> str | None:
    """A verb's epilog (a paragraph, wrapped as argparse would) followed by its `Examples:`: each a
    command line as typed, with what it does after `#`."""
    width = max(40, shutil.get_terminal_size().columns - 2)  # argparse's own width
    parts = [textwrap.fill(epilog, width)] if epilog else []
    if examples:
        parts.append("\n".join(["Examples:", *(f"  {example}" for example in examples)]))
    return "\n\n".join(parts) or None


def verb_parser(verb: str) -> tuple[ModuleType, argparse.ArgumentParser]:
    """The verb's module and its command line parser (without what follows `--`)."""
    module_name, help_text = COMMANDS[verb]
    module = importlib.import_module(module_name)
    # Raw: the examples keep their lines; the rest of the epilog is wrapped by `epilog_with_examples`.
    parser = argparse.ArgumentParser(
        prog=f"trainer {verb}", description=help_text, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    module.configure_parser(parser)
    parser.epilog = epilog_with_examples(parser.epilog, getattr(module, "EXAMPLES", ()))
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=logsetup.LEVELS,
        help=f"this command's own log lines on stderr (time, host, rank, level); default: "
        f"${logsetup.LEVEL_VARIABLE} or {logsetup.DEFAULT_LEVEL} (for the nodes of a launch: "
        f"--env {logsetup.LEVEL_VARIABLE}=DEBUG)",
    )
    return module, parser


def _repeated_option(args: list[str], option: str) -> str | None:
    """A problem when `option` is given twice with different values (argparse would keep the last one
    silently), else None."""
    values = []
    for index, arg in enumerate(args):
        if arg == option and index + 1 < len(args):
            values.append(args[index + 1])
        elif arg.startswith(f"{option}="):
            values.append(arg.partition("=")[2])
    if len(set(values)) > 1:
        return f"{option} given {len(values)} times ({', '.join(values)}); give one"
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return exitcodes.OK if argv else exitcodes.CONFIG_ERROR
    if argv[0] == "--version":
        print(f"trainer {__version__}")
        return exitcodes.OK
    verb, rest = argv[0], argv[1:]
    if verb not in COMMANDS:
        print(f"trainer: unknown command {verb!r}\n\n{_usage()}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    module, parser = verb_parser(verb)
    command: list[str] = []
    if getattr(module, "TAKES_COMMAND", False) and "--" in rest:
        split = rest.index("--")
        rest, command = rest[:split], rest[split + 1 :]
    if problem := _repeated_option(rest, "--config"):
        print(f"trainer {verb}: {problem}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    args = parser.parse_args(rest)
    if getattr(module, "TAKES_COMMAND", False):
        args.command = command
    for item in getattr(args, "overrides", None) or []:
        if problem := secret_set_problem(item):  # in `ps` for the whole run, wherever it runs
            print(f"trainer {verb}: {problem}", file=sys.stderr)
            return exitcodes.CONFIG_ERROR
    try:
        logsetup.configure(args.log_level)
    except logsetup.LogLevelError as err:
        print(f"trainer {verb}: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    return int(module.run(args) or exitcodes.OK)


if __name__ == "__main__":
    sys.exit(main())
