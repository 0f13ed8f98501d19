#!/usr/bin/env python3
"""Where the bed's converge spent its time, for CI's tail: each role's seconds and the node
environment's phases, read from the Molecule log's converge step (profile_tasks' and profile_roles'
recaps, which molecule/default/molecule.yml turns on, every task listed).

    converge_times.py MOLECULE_LOG      prints a few lines; nothing when the log has no converge recap

Molecule wraps long lines and prefixes each with a box character; a recap entry is the text up to
the `- 12.34s` that ends it, however many lines that took.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ANSI = re.compile(r"\x1b\[[0-9;]*m")
ENTRY_END = re.compile(r"^(?P<name>.*?)\s-*\s(?P<seconds>\d+\.\d+)s$")
#: roles/trainer_env's tasks that are the environment's phases (the build's tasks are the slow ones).
ENV_PHASES = {
    "Install torch": "build: torch",
    "Install the training stack": "build: the stack",
    "Build DeepSpeed's ops": "build: DeepSpeed's ops",
    "Copy the packed wheelhouse": "build: the wheelhouse's copy",
    "Copy the controller's kept pack": "seed: the kept pack's copy",
    "Unpack it, checked against the sha256 the controller kept": "seed: its unpack",
    "Pack the environment": "pack",
    "Publish each new pack": "publish",
    "Unpack the environment": "unpack",
    "Fetch each new pack": "keep: the fetch to the controller",
}


def converge_text(log: str) -> str:
    """The converge step's output (up to the next Molecule step)."""
    log = ANSI.sub("", log)
    start = log.find("converge: Executing")
    if start < 0:
        return ""
    end = log.find("idempotence: Executing", start)
    return log[start : end if end > 0 else len(log)]


def recap_entries(text: str) -> list[tuple[str, float]]:
    """(name, seconds) of every entry after the recaps' header, joined across wrapped lines."""
    lines = [line.strip().lstrip("│").strip() for line in text.splitlines()]
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("TASKS RECAP"))
    except StopIteration:
        return []
    entries, pending = [], ""
    for line in lines[start + 1 :]:
        if not line or set(line) <= set("=*"):
            pending = ""  # a header's rule: what came before it was the header (the date line)
            continue
        pending = f"{pending} {line}".strip()
        if match := ENTRY_END.match(pending):
            entries.append((match["name"].strip(" -"), float(match["seconds"])))
            pending = ""
        elif len(pending) > 400:  # not a recap line (a date line, a header): drop it
            pending = ""
    return entries


def summary(entries: list[tuple[str, float]]) -> list[str]:
    # profile_roles also lists tasks outside roles by module name (ansible.builtin.set_fact ...).
    roles = {name: took for name, took in entries if not {" ", "."} & set(name) and name != "total"}
    phases: dict[str, float] = {}
    for name, seconds in entries:
        role, _, task = name.partition(" : ")
        if role == "trainer_env":
            for prefix, phase in ENV_PHASES.items():
                if task.startswith(prefix):
                    phases[phase] = phases.get(phase, 0.0) + seconds
    lines = []
    if roles:
        shown = ", ".join(
            f"{role} {seconds:.0f} s" for role, seconds in sorted(roles.items(), key=lambda r: -r[1])
        )
        lines.append(f"converge by role: {shown}")
    if phases:
        lines.append(
            "converge, the node environment: " + ", ".join(f"{p} {s:.0f} s" for p, s in phases.items())
        )
    return lines


def main() -> int:
    log = Path(sys.argv[1]).read_text(errors="replace")
    for line in summary(recap_entries(converge_text(log))):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
