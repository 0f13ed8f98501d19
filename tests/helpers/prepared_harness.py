"""One process of a job getting its fine-tuning data through the prepared-data cache
(trainer.node.hf.prepared), started by the tests as torchrun would start it: RANK, LOCAL_RANK and the
job's id in the environment, before any process group. It prints one JSON line: what it got (a
digest of the arrays, the last note, the CPU seconds the call took) or the error it stopped with.

The cache's timings (heartbeat, stale lock, grace) are arguments, so a test of a dead preparer waits
seconds, not minutes; everything else is the trainer's own code on the tiny model and real data.

    python tests/helpers/prepared_harness.py --dir DIR --stale 2 -- model.name_or_path=... data.path=...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def digest(data) -> str:
    """The arrays a run trains on, by content: equal digests, equal training data."""
    parts = [data.train.ids, data.train.labels, data.train.offsets, data.rows.members, data.rows.offsets]
    if data.eval is not None:
        parts += [data.eval.ids, data.eval.labels, data.eval.offsets]
    sha = hashlib.sha256()
    for array in parts:
        sha.update(str(array.dtype).encode() + array.tobytes())
    return sha.hexdigest()


def spawn(
    sets: list[str],
    cache_dir: Path,
    *,
    rank: int,
    local_rank: int,
    job: str = "job-1",
    stale: float = 120.0,
    heartbeat: float = 10.0,
    grace: float = 5.0,
    no_preparer: float = 600.0,
) -> subprocess.Popen:
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(local_rank), CLUSTERTRAIN_LAUNCH_ID=job)
    env.pop("CLUSTER_JOB_ID", None)
    command = [
        sys.executable, __file__, "--dir", str(cache_dir), "--stale", str(stale),
        "--heartbeat", str(heartbeat), "--grace", str(grace), "--no-preparer", str(no_preparer), "--", *sets,
    ]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(process: subprocess.Popen, timeout: float = 300) -> dict:
    out, err = process.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"no result (exit {process.returncode}):\n{out}\n{err[-3000:]}"
    return json.loads(lines[-1]) | {"stderr": err, "returncode": process.returncode}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    for name in ("stale", "heartbeat", "grace", "no-preparer"):
        parser.add_argument(f"--{name}", type=float, required=True)
    parser.add_argument("sets", nargs="*")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from trainer.configerror import ConfigError
    from trainer.node.config import load_config
    from trainer.node.data import DataError
    from trainer.node.hf import prepared
    from trainer.node.hf.model import check_source, load_tokenizer
    from trainer.node.hf.training_data import build_training_data

    config = load_config(None, args.sets)
    tokenizer = load_tokenizer(config.model, check_source(config.model.name_or_path))
    cache = prepared.PreparedCache(
        args.dir,
        explicit=True,
        heartbeat_s=args.heartbeat,
        stale_after_s=args.stale,
        grace_s=args.grace,
        no_preparer_s=args.no_preparer,
    )
    process = prepared.Process.from_env()
    started, cpu = time.monotonic(), time.process_time()
    try:
        key, inputs = prepared.cache_key(config, tokenizer)
        data = cache.get(
            key,
            inputs,
            lambda: build_training_data(config, tokenizer),
            tokenizer,
            process,
            lambda line: print(f"say: {line}", file=sys.stderr, flush=True),
        )
    except (ConfigError, DataError) as err:
        print(
            json.dumps({"error": str(err), "kind": type(err).__name__, "seconds": time.monotonic() - started})
        )
        return 2
    print(
        json.dumps(
            {
                "digest": digest(data),
                "note": data.notes[-1],
                "facts": data.facts,
                "cpu_seconds": time.process_time() - cpu,
                "seconds": time.monotonic() - started,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
