"""Scaling: tokens/s of 2 hosts x 1 process against 1 host x 1 process, same per-process batch.

Both jobs go through `trainer launch` (the embedded default model, gloo) and the numbers come from
the trainer's own metrics.jsonl (tokens_per_s counts every rank's tokens), median over the logged
intervals after the first (which holds start-up). Efficiency = tokens/s(2 hosts) / (2 x tokens/s(1 host)).

Hosts: the Molecule test bed (ct-head, ct-worker1) when /tmp/clustertrain-testbed.status says
`up`, else loopback "hosts" on this machine (`--loopback` forces that). Note that the test bed's
containers share this machine's CPU cores, so this measures the launcher and gloo's overhead on
shared cores, not a network of real machines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch import free_port, make_inventory, testbed_up  # the sibling benchmark

STEPS = 30
TRAIN_SETS = [
    f"train.max_steps={STEPS}",
    "train.warmup_steps=2",
    "train.log_every=5",
    "checkpoint.save_steps=0",
]


def tokens_per_s(inventory: Path, run_name: str) -> tuple[float, int]:
    """Median tokens/s of a launch (all ranks) and its world size."""
    sets = [arg for item in TRAIN_SETS for arg in ("--set", item)]
    command = [sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--run-name", run_name, *sets]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"trainer launch failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr}"
        )
    plan = json.loads(
        subprocess.run(
            [sys.executable, "-m", "trainer", "plan", "-i", str(inventory), "--run-name", run_name, "--json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    records = [
        json.loads(line) for line in Path(plan["output_dir"], "metrics.jsonl").read_text().splitlines()
    ]
    steady = [r["tokens_per_s"] for r in records[1:]] or [r["tokens_per_s"] for r in records]
    shutil.rmtree(plan["output_dir"], ignore_errors=True)
    return statistics.median(steady), int(records[-1]["world_size"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loopback", action="store_true", help="loopback hosts even if the test bed is up")
    args = parser.parse_args()
    loopback = args.loopback or not testbed_up()
    where = "loopback hosts on this machine" if loopback else "the test bed (ct-head, ct-worker1)"
    print(f"scaling on {where}: 1 process per host, same per-process batch, {STEPS} steps each")
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        for hosts in (1, 2):
            workdir = Path(tmp) / f"h{hosts}"
            workdir.mkdir()
            port = free_port() if loopback else 29532 + hosts
            inventory, _ = make_inventory(workdir, loopback, hosts=hosts, port=port)
            results[hosts] = tokens_per_s(inventory, f"bench-scaling-{hosts}-{os.getpid()}")
    (one, _), (two, world) = results[1], results[2]
    print(f"1 host  x 1 process : {one:10,.0f} tokens/s")
    print(f"2 hosts x 1 process : {two:10,.0f} tokens/s (world size {world})")
    print(f"speed-up {two / one:.2f}x, scaling efficiency {two / (2 * one):.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
