"""pip against uv for the node environment's build: torch and the training stack from the offline
wheelhouse into a fresh venv, as trainer_env's builder does, in interleaved rounds (pip, uv, uv, pip...).

    .venv/bin/python bench/env_install.py [--rounds 2] [--wheelhouse .cache/wheelhouse]

Both install the same pinned torch first, then the `train` extra's list (scripts/build-node-wheel.py
writes it), with no index. "cold": a fresh venv and an empty installer cache (uv's cache in a fresh
dir, pip's off), as a new node has. Prints each round's seconds and the medians' ratio. uv is
taken from this venv (`pip install uv`); the nodes would need it in the wheelhouse.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def requirements() -> Path:
    out = subprocess.run(
        [sys.executable, str(REPO / "scripts/build-node-wheel.py"), "--out", str(REPO / ".cache/bench")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return Path(json.loads(out.stdout)["requirements"])


def install(tool: str, wheelhouse: Path, reqs: Path, torch: str) -> float:
    work = Path(tempfile.mkdtemp(prefix=f"env-install-{tool}-"))
    try:
        venv = work / "venv"
        made = [sys.executable, "-m", "venv", *(["--without-pip"] if tool == "uv" else []), str(venv)]
        subprocess.run(made, check=True, capture_output=True)
        started = time.monotonic()
        if tool == "pip":
            pip = [
                str(venv / "bin" / "pip"),
                "install",
                "-q",
                "--disable-pip-version-check",
                "--no-cache-dir",
            ]
            pip += ["--no-index", "--find-links", str(wheelhouse)]
            subprocess.run([*pip, torch], check=True)
            subprocess.run([*pip, "-r", str(reqs)], check=True)
        else:
            uv = shutil.which("uv") or str(Path(sys.executable).parent / "uv")
            base = [
                uv,
                "pip",
                "install",
                "-q",
                "--python",
                str(venv / "bin" / "python"),
                "--cache-dir",
                str(work / "cache"),
            ]
            base += ["--no-index", "--find-links", str(wheelhouse)]
            subprocess.run([*base, torch], check=True)
            subprocess.run([*base, "-r", str(reqs)], check=True)
        return time.monotonic() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--wheelhouse", type=Path, default=REPO / ".cache" / "wheelhouse")
    parser.add_argument("--torch", default="torch==2.13.0")
    args = parser.parse_args()
    reqs = requirements()
    times: dict[str, list[float]] = {"pip": [], "uv": []}
    for round_ in range(args.rounds):
        order = ("pip", "uv") if round_ % 2 == 0 else ("uv", "pip")
        for tool in order:
            seconds = install(tool, args.wheelhouse, reqs, args.torch)
            times[tool].append(seconds)
            print(f"round {round_ + 1}: {tool:<3} {seconds:6.1f} s", flush=True)
    pip, uv = statistics.median(times["pip"]), statistics.median(times["uv"])
    print(f"median: pip {pip:.1f} s, uv {uv:.1f} s; uv takes {uv / pip:.2f}x pip's time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
