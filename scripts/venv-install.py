#!/usr/bin/env python3
"""Install packages into this project's venv with uv, under this machine's pip settings.

    scripts/venv-install.py VENV REQUIREMENT...    (as `pip install` takes them: -e ".[train]", torch==2.13.0)

uv installs the same packages several times faster than pip, which the Makefile's set-up (`make
install`, `install-train`, `install-dev`: the first minutes of every fresh machine and of every CI run)
spent most of its time in. uv reads none of pip's settings, so the ones that decide what gets
installed are read from `pip config list` (pip.conf files and PIP_* variables alike) and handed to uv:
the index and extra indexes, find-links (a local torch build), constraint files, a CA bundle, the
network timeout, --no-index. pip's own way of choosing among several indexes (the best version from
any of them) is kept, so the same packages come out. Bytecode is compiled as pip compiles it: uv does
not by default, and where PYTHONDONTWRITEBYTECODE is set nothing would compile it later, so every
process would compile torch's modules again at its start.

uv goes into the venv first, with the venv's pip (under the same settings). Standard library only: it
runs before anything else is installed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

#: pip's settings that choose what gets installed -> uv's option for each value (None: a flag).
LIST_OPTIONS = {
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}
SINGLE_OPTIONS = {"index-url": "--index-url"}
#: pip's key -> the variable uv reads instead.
ENV_SETTINGS = {"cert": "SSL_CERT_FILE", "default-timeout": "UV_HTTP_TIMEOUT", "timeout": "UV_HTTP_TIMEOUT"}
#: `pip config list` lines: section.key='value' (section: global, install, or :env: for PIP_* variables).
CONFIG_LINE = re.compile(r"^(?P<section>[^.]*)\.(?P<key>[a-z-]+)='(?P<value>.*)'$")
#: Which section wins where a key is set in several, as pip decides: the command's own section over
#: global, the environment over files.
SECTION_RANK = {"global": 0, "install": 1, ":env:": 2}


def pip_settings(pip: Path) -> dict[str, str]:
    """key -> value of pip's effective settings (the highest-ranked section for each key)."""
    listed = subprocess.run([str(pip), "config", "list"], capture_output=True, text=True, check=True).stdout
    chosen: dict[str, tuple[int, str]] = {}
    for line in listed.splitlines():
        match = CONFIG_LINE.match(line.strip())
        if not match or match["section"] not in SECTION_RANK:
            continue
        rank = SECTION_RANK[match["section"]]
        if match["key"] not in chosen or rank >= chosen[match["key"]][0]:
            chosen[match["key"]] = (rank, match["value"])
    return {key: value for key, (_, value) in chosen.items()}


def uv_arguments(settings: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """uv's options and environment for pip's settings."""
    options, env = [], {}
    for key, option in LIST_OPTIONS.items():
        for value in settings.get(key, "").split():
            options += [option, value]
    for key, option in SINGLE_OPTIONS.items():
        if settings.get(key):
            options += [option, settings[key]]
    if settings.get("no-index", "").lower() in ("1", "true", "yes", "on"):
        options.append("--no-index")
    for key, variable in ENV_SETTINGS.items():
        if settings.get(key):
            env[variable] = settings[key]
    return options, env


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    venv, requirements = Path(sys.argv[1]), sys.argv[2:]
    pip, uv = venv / "bin" / "pip", venv / "bin" / "uv"
    if not os.access(uv, os.X_OK):
        subprocess.run([str(pip), "install", "-q", "--disable-pip-version-check", "uv"], check=True)
    options, env = uv_arguments(pip_settings(pip))
    command = [
        str(uv), "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
        "--compile-bytecode", "--index-strategy", "unsafe-best-match", *options, *requirements,
    ]  # fmt: skip
    print("venv-install:", shlex.join(command[1:]), file=sys.stderr)
    return subprocess.run(command, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main())
