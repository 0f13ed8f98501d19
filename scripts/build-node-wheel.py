#!/usr/bin/env python3
"""Build this checkout's wheel for the nodes, and the list of what the nodes install beside it.

The nodes never look the project up on a package index (the name is not published there, and a
stranger could publish it): the trainer_env role copies this wheel from the controller and installs
it with --no-deps, then the training stack from `node-requirements.txt`, which is the wheel's own
`train` extra. So the nodes get torch and friends and none of the controller's packages (Ansible).

    build-node-wheel.py --out DIR     prints {"wheel": PATH, "requirements": PATH, "source_hash": H}

Cached by the hash of the sources: an unchanged checkout reuses the wheel it built, byte for byte,
so a second `site.yml` run copies and reinstalls nothing. The output dir is private to its owner.
Runs with the controller's Python (the one that runs Ansible): standard library plus pip.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent
#: What goes into the wheel (pyproject's package data included); anything else does not change it.
SOURCE_PARTS = ("pyproject.toml", "README.md", "trainer")
EXTRA = "train"
#: Zip timestamps of the built wheel (setuptools honours it): same sources give the same bytes.
SOURCE_DATE_EPOCH = "315532800"
KEEP_BUILDS = 3


def source_files() -> list[Path]:
    files: list[Path] = []
    for part in SOURCE_PARTS:
        path = SOURCE / part
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [
                p
                for p in path.rglob("*")
                if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")
            ]
    return sorted(files)


def source_hash(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(SOURCE)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def requirements_of_extra(wheel: Path, extra: str) -> list[str]:
    """The wheel's `Requires-Dist: X; extra == "train"` lines, as plain requirement lines."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    marker = re.compile(r"""^(.*?);\s*extra\s*==\s*["']""" + re.escape(extra) + r"""["']\s*$""")
    requirements = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            match = marker.match(line.removeprefix("Requires-Dist:").strip())
            if match:
                requirements.append(match.group(1).strip())
    if not requirements:
        raise SystemExit(f"{wheel.name} declares no '{extra}' extra: nothing to install on the nodes")
    return requirements


def build(out: Path, digest: str, files: list[Path]) -> Path:
    """Build into a fresh directory next to the final one, then rename it into place (atomic)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{digest}.", dir=out))
    try:
        tree = staging / "src"
        for path in files:
            target = tree / path.relative_to(SOURCE)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        try:
            import setuptools  # noqa: F401 - only probing: without it, pip builds in isolation
        except ImportError:
            isolation: list[str] = []  # pip fetches setuptools from the controller's index
        else:
            isolation = ["--no-build-isolation"]
        env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        wheels = staging / "wheel"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "-q",
                "--no-deps",
                *isolation,
                "-w",
                str(wheels),
                str(tree),
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if run.returncode != 0:
            raise SystemExit(f"building the clustertrain wheel failed:\n{run.stderr[-3000:]}")
        shutil.rmtree(tree)
        (wheel,) = wheels.glob("clustertrain-*.whl")
        shutil.move(str(wheel), staging / wheel.name)
        wheels.rmdir()
        (staging / "node-requirements.txt").write_text(
            "\n".join(requirements_of_extra(staging / wheel.name, EXTRA)) + "\n"
        )
        final = out / digest
        staging.rename(final)
        return final
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def prune(out: Path, keep: Path) -> None:
    builds = sorted(
        (p for p in out.iterdir() if p.is_dir() and not p.name.startswith(".")), key=os.path.getmtime
    )
    for old in builds[:-KEEP_BUILDS]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="cache directory (created 0700)")
    args = parser.parse_args()
    out = args.out.expanduser()
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    if out.stat().st_uid != os.getuid() or out.stat().st_mode & 0o022:
        raise SystemExit(f"{out} must belong to you and not be writable by others (chmod 700 {out})")
    files = source_files()
    digest = source_hash(files)
    final = out / digest
    if not (final.is_dir() and list(final.glob("clustertrain-*.whl"))):
        final = build(out, digest, files)
    prune(out, final)
    (wheel,) = final.glob("clustertrain-*.whl")
    print(
        json.dumps(
            {"wheel": str(wheel), "requirements": str(final / "node-requirements.txt"), "source_hash": digest}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
