"""Logging, configured once per process by `trainer.cli.main` (every verb, both sides).

Every record goes to stderr as `TIME HOST [rank R] LEVEL LOGGER: message`, so a warning in a merged
multi-node log says where and when it happened. The trainer's own loggers (`trainer.*`) log at the
chosen level (`--log-level`, else TRAINER_LOG_LEVEL, else INFO: the health monitor's and the trackers'
info lines are shown); other libraries' loggers stay at WARNING so DEBUG here is ours, not theirs.

The step lines, the progress bar and the final messages are prints to stdout, not log records: their
format is a contract the launcher parses, and it does not change with the level.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LEVEL_VARIABLE = "TRAINER_LOG_LEVEL"
DEFAULT_LEVEL = "INFO"
#: The handler this module installs on the root logger (found again, never added twice).
HANDLER_NAME = "clustertrain"


class LogLevelError(ValueError):
    pass


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time (a test's capture, a redirected stream), as
    logging's own last-resort handler does, never to a stream closed since."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def resolve_level(value: str | None) -> str:
    """The level asked for (option, then TRAINER_LOG_LEVEL, then INFO), upper-cased and checked."""
    raw = value or os.environ.get(LEVEL_VARIABLE) or DEFAULT_LEVEL
    level = raw.strip().upper()
    if level not in LEVELS:
        source = "--log-level" if value else LEVEL_VARIABLE
        raise LogLevelError(f"{source} must be one of {', '.join(LEVELS)} (got {raw!r})")
    return level


def line_format(host: str, rank: str | None) -> str:
    where = f"{host} rank {rank}" if rank is not None else host
    return "%(asctime)s " + where.replace("%", "%%") + " %(levelname)s %(name)s: %(message)s"


def configure(level: str | None = None) -> str:
    """Install the one stderr handler (once per process; a second call only changes the level).
    The rank comes from torchrun's RANK variable when set. Returns the level in force."""
    chosen = resolve_level(level)
    root = logging.getLogger()
    handler = next((h for h in root.handlers if h.get_name() == HANDLER_NAME), None)
    if handler is None:
        handler = _StderrHandler()
        handler.set_name(HANDLER_NAME)
        formatter = logging.Formatter(
            line_format(socket.gethostname(), os.environ.get("RANK")), "%Y-%m-%dT%H:%M:%SZ"
        )
        formatter.converter = time.gmtime  # one clock for every node's lines: UTC
        handler.setFormatter(formatter)
        root.addHandler(handler)
        if root.level == logging.NOTSET or root.level > logging.WARNING:
            root.setLevel(logging.WARNING)
    logging.getLogger("trainer").setLevel(chosen)
    # The handler passes what the loggers let through: the trainer's DEBUG, the others' WARNING.
    handler.setLevel(logging.DEBUG)
    return chosen
