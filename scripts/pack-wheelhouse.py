#!/usr/bin/env python3
"""Pack the wheelhouse into one reproducible tar for the nodes, once per change of its contents.

    pack-wheelhouse.py --wheelhouse DIR --out TAR     prints {"tar": TAR, "sha1": H, "packed": bool}

The trainer_env role copies one tar instead of one file per wheel (each file is a round trip per
host) and compares its sha1 with the one the node recorded. Packing and hashing ~300 MB took
seconds of every idempotent run, so the tar and its sha1 are kept next to a listing of the
wheelhouse (name, size, mtime of each file): an unchanged listing reuses both. The tar's bytes
depend only on the files (sorted names, fixed mtime and owner), as before, so nodes provisioned
by an earlier version keep their wheelhouse. Runs with the controller's Python, standard library only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path


def listing(wheelhouse: Path) -> str:
    rows = []
    for path in sorted(wheelhouse.rglob("*")):
        if path.is_file():
            info = path.stat()
            rows.append(f"{path.relative_to(wheelhouse)}\t{info.st_size}\t{info.st_mtime_ns}")
    return "\n".join(rows) + "\n"


def sha1_of(path: Path) -> str:
    digest = hashlib.sha1()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheelhouse", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    tar, stamp = args.out, args.out.with_name(args.out.name + ".stamp.json")
    current = listing(args.wheelhouse)
    try:
        kept = json.loads(stamp.read_text())
        if kept["listing"] == current and tar.is_file() and tar.stat().st_size == kept["size"]:
            print(json.dumps({"tar": str(tar), "sha1": kept["sha1"], "packed": False}))
            return 0
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tar.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = tar.with_name(tar.name + f".{os.getpid()}.partial")
    subprocess.run(
        ["tar", "--sort=name", "--mtime=@0", "--owner=0", "--group=0", "--numeric-owner",
         "-cf", str(partial), "-C", str(args.wheelhouse), "."],
        check=True,
    )  # fmt: skip
    os.replace(partial, tar)
    record = {"listing": current, "size": tar.stat().st_size, "sha1": sha1_of(tar)}
    stamp.write_text(json.dumps(record))
    print(json.dumps({"tar": str(tar), "sha1": record["sha1"], "packed": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
