"""A node's output told apart: the ranks' own lines, and a launcher's (torchrun's) traceback and failure
summary, which follow every failure and stop with 20 to 40 lines about torchrun itself.

The launcher's block is kept in the node log (node_ctl writes everything there) but not shown on the
operator's screen or in the failure report's last lines; one line stands in for it. The ranks' own
error line (a Python exception's last line, `python: can't open file ...`, a shell's `No such file or
directory`) is remembered: it is the first line of the failure report where no rank wrote an exit
record (a user's command).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: A traceback of a launcher's own code: its first frame is the launcher's entry point or module.
LAUNCHER_FRAME = re.compile(
    r'^\s*File ".*(/bin/(torchrun|accelerate|deepspeed)|/torch/distributed/(run|launch)\.py|'
    r"/accelerate/commands/|/deepspeed/launcher/)"
)
TRACEBACK = "Traceback (most recent call last):"
#: torchrun's failure summary: a rule of `=`, its body, a closing rule.
RULE = re.compile(r"^={20,}\s*$")
#: The line that ends a launcher's traceback: the exception torchrun or accelerate raises for a child.
LAUNCHER_EXCEPTION = re.compile(
    r"^(torch\.distributed\.elastic\.\S*ChildFailedError|subprocess\.CalledProcessError)"
)
#: A rank's own error line.
OWN_ERROR = re.compile(
    r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure)(?::\s.*)?"
    r"|\S*python[\d.]*: (?:can't open file|No module named|Error while finding module).*"
    r"|(?:\S*/)?(?:ba|da|z)?sh: .*(?:No such file or directory|command not found|Permission denied).*)$"
)


@dataclass
class RankOutput:
    """Feed it a node's lines in order; `feed` says which to show."""

    own_error: str = ""
    """The first error line of the ranks' own (not a launcher's), once one was seen."""
    hidden: int = 0
    """Lines of launcher blocks kept off the screen so far."""
    _held: list[str] = field(default_factory=list)
    """A `Traceback` line waiting for its first frame, which says whose it is."""
    _state: str = "out"
    """out | traceback (a launcher's) | summary (inside torchrun's rules) | after (its exception seen)."""

    def feed(self, line: str) -> list[str]:
        """The lines to show now for `line` (none, it, or a held line with it)."""
        if self._held:
            held = self._held.pop()
            if LAUNCHER_FRAME.match(line):
                self._state, self.hidden = "traceback", 2
                return []
            return [*self._shown(held), *self.feed(line)]
        if self._state == "traceback":
            self.hidden += 1
            if match := LAUNCHER_EXCEPTION.match(line):
                if "ChildFailedError" in match.group(1):
                    self._state = "after"  # torchrun's failure summary follows
                    return []
                self._state = "out"
                return [f"(the launcher's traceback, {self.hidden} lines: in this node's log)"]
            return []
        if self._state == "after":
            if RULE.match(line):
                self._state, self.hidden = "summary", self.hidden + 1
                return []
            self._state = "out"
            return [f"(the launcher's traceback, {self.hidden} lines: in this node's log)", *self.feed(line)]
        if self._state == "summary":
            self.hidden += 1
            if RULE.match(line):
                self._state = "out"
                return [
                    f"(the launcher's traceback and failure summary, {self.hidden} lines: in this node's log)"
                ]
            return []
        if line.strip() == TRACEBACK:
            self._held.append(line)
            return []
        return self._shown(line)

    def _shown(self, line: str) -> list[str]:
        if not self.own_error and OWN_ERROR.match(line.strip()):
            self.own_error = line.strip()
        return [line]

    def flush(self) -> list[str]:
        """What is held back still (a `Traceback` line whose next line has not come)."""
        held, self._held = self._held, []
        return held
