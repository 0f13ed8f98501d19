"""How much CPU does a 3-process job spend preparing its fine-tuning data, against one process preparing
alone? (goal: <= 1.2x; N x G when every process prepares its own copy)

A tiny Qwen2 tokenizer and N conversations (scripts/build_tiny_hf_model.py, offline). Each worker is one
process of a job as torchrun starts it (RANK, LOCAL_RANK, the job's id in its environment), and times
with time.process_time (every thread of the process: the tokenizer's too) the call FineTune.prepare
makes for its data, trainer.node.hf.prepared.training_data; loading the tokenizer is left out.

    alone   one process, data.prepare_once=false: the work itself
    before  3 processes, data.prepare_once=false: each prepares its own copy (as before the cache)
    after   3 processes, data.prepare_once=true, an empty cache: one prepares, two wait and map it

All three in one run (the machine may be shared: a figure from another minute is not comparable).

    python bench/data_prep.py [--samples 8000]

The same file is the worker (`--worker`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def worker(sets: list[str]) -> None:
    sys.path.insert(0, str(REPO))
    from trainer.node.config import load_config
    from trainer.node.hf import prepared
    from trainer.node.hf.model import check_source, load_tokenizer

    config = load_config(None, sets)
    tokenizer = load_tokenizer(config.model, check_source(config.model.name_or_path))
    cpu, wall = time.process_time(), time.monotonic()
    data = prepared.training_data(config, tokenizer)
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    print(json.dumps({"cpu_s": cpu, "wall_s": wall, "rows": len(data.rows), "note": data.notes[-1]}))


def job(processes: int, sets: list[str], name: str) -> list[dict]:
    started = []
    for rank in range(processes):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(processes))
        env |= {"CLUSTERTRAIN_LAUNCH_ID": f"bench-{name}-{os.getpid()}", "TOKENIZERS_PARALLELISM": "false"}
        command = [sys.executable, __file__, "--worker", "--", *sets]
        started.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for process in started:
        out, _ = process.communicate(timeout=1800)
        if process.returncode != 0:
            sys.exit(f"{name}: a worker failed (exit {process.returncode})")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=8000, help="conversations in the dataset")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("sets", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.sets)
        return
    with tempfile.TemporaryDirectory(prefix="bench-data-prep-") as tmp:
        build = [sys.executable, str(REPO / "scripts" / "build_tiny_hf_model.py")]
        subprocess.run([*build, "model", f"{tmp}/model"], check=True, capture_output=True)
        data = f"{tmp}/conversations.jsonl"
        subprocess.run([*build, "data", data, "--jsonl", "--samples", str(args.samples)], check=True)
        sets = [
            f"model.name_or_path={tmp}/model", f"data.path={data}", "model.max_length=256",
            "data.packing=true", f"output_dir={tmp}/out",
        ]  # fmt: skip
        alone = job(1, [*sets, "data.prepare_once=false"], "alone")[0]["cpu_s"]
        before = job(3, [*sets, "data.prepare_once=false"], "before")
        after = job(3, [*sets, f"data.prepared_dir={tmp}/prepared"], "after")
    print(f"data: {args.samples} conversations; CPU seconds of data preparation (time.process_time)")
    print(f"  {'one process alone:':48}{alone:7.2f} s")
    for name, results in (("before (every process prepares)", before), ("after (prepared once)", after)):
        per = ", ".join(f"{r['cpu_s']:.2f}" for r in results)
        total = sum(r["cpu_s"] for r in results)
        print(f"  {'3 processes, ' + name + ':':48}{total:7.2f} s ({per}) = {total / alone:.2f}x alone")
    print(f"  after: {after[0]['note']}")


if __name__ == "__main__":
    main()
