"""How much does `trainer train` cost over a minimal hand-written DDP loop? (goal: ratio >= 0.97)

Both train the same tiny GPT on the same bundled text with the same batch on 2 processes under
torchrun (gloo on the CPU). Throughput is steady-state tokens/s: the first 10 steps (start-up, first
allocations) and checkpoint writes are left out of both. The machine may be shared, so the two run
back to back in rounds, each round giving the ratio of two runs made under about the same load. On a
busy machine whichever runs first in a round tends to be faster, so the order follows A-B, B-A,
B-A, A-B (balanced over every 4 rounds) and the figure is the geometric mean of the round ratios.

Because end-to-end runs on a shared machine swing by ±50% from one minute to the next, a second
figure removes the load entirely: in the same 2 processes, one step of the trainer's engine (its
data sharding, DDP engine, optimizer and LR schedule: everything `trainer train` does per step) and
one step of the hand-written loop alternate, 200 times, and the summed step times are compared.

    python bench/trainer_overhead.py [--rounds 4] [--steps 60]

The same file is the baseline worker (`--worker`, started by torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
MICRO_BATCH, BLOCK, WARMUP_STEPS, LOG_EVERY = 16, 64, 10, 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(args: list[str], cwd: str) -> subprocess.CompletedProcess:
    command = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), *args]
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{done.stderr[-3000:]}")
    return done


def trainer_tokens_per_s(steps: int, workdir: str) -> float:
    out = Path(workdir) / "trainer-out"
    overrides = [
        f"output_dir={out}", f"train.max_steps={steps}", f"train.micro_batch_size={MICRO_BATCH}",
        f"data.block_size={BLOCK}", f"train.log_every={LOG_EVERY}", "checkpoint.save_steps=0",
        "checkpoint.resume=never", "distributed.engine=ddp",
    ]  # fmt: skip
    torchrun([str(BIN / "trainer"), "train", *[a for o in overrides for a in ("--set", o)]], workdir)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["step"] > WARMUP_STEPS]
    # Each record's rate covers LOG_EVERY steps of equal token count: the overall rate is their harmonic mean.
    return len(steady) / sum(1 / r["tokens_per_s"] for r in steady)


def baseline_tokens_per_s(steps: int, workdir: str) -> float:
    done = torchrun([__file__, "--worker", "--steps", str(steps)], workdir)
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]


def interleaved_ratio(steps: int, workdir: str) -> float:
    done = torchrun([__file__, "--interleaved-worker", "--steps", str(steps)], workdir)
    return json.loads(done.stdout.strip().splitlines()[-1])["ratio"]


def interleaved_worker(steps: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainer.node import distributed
    from trainer.node.config import load_config
    from trainer.node.data import ShardedBatches, load_corpus
    from trainer.node.engines import create_engine
    from trainer.node.model import GPT
    from trainer.node.order import START

    config = load_config(None, [f"train.micro_batch_size={MICRO_BATCH}", f"data.block_size={BLOCK}"])
    topology = distributed.discover("gloo")
    distributed.start(topology, 300)
    corpus = load_corpus(config.data)
    torch.manual_seed(1337)
    engine = create_engine(
        config.train,
        config.distributed,
        Path(config.output_dir),
        topology,
        GPT(config.model, vocab_size=len(corpus.vocab), block_size=BLOCK),
        bf16=False,
    )
    batches = ShardedBatches(
        corpus,
        repeats=1,
        micro_batch_size=MICRO_BATCH,
        rank=topology.rank,
        world_size=topology.world_size,
        seed=1,
    )
    batches.start(START, accumulation=1)
    torch.manual_seed(1337)
    model = DistributedDataParallel(GPT(config.model, vocab_size=len(corpus.vocab), block_size=BLOCK))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    window = torch.arange(BLOCK + 1)
    trainer_time = baseline_time = 0.0
    for step in range(1, steps + 1):
        started = time.perf_counter()
        engine.train_step(batches.micro_batches(step))
        engine.lr()
        middle = time.perf_counter()
        starts = torch.randint(len(corpus.ids) - BLOCK - 1, (MICRO_BATCH,))
        chunk = corpus.ids[starts[:, None] + window]
        model(chunk[:, :-1], chunk[:, 1:]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step > WARMUP_STEPS:
            trainer_time += middle - started
            baseline_time += time.perf_counter() - middle
    if dist.get_rank() == 0:
        print(json.dumps({"ratio": baseline_time / trainer_time}), flush=True)
    distributed.shutdown(clean=True)


def worker(steps: int) -> None:
    """The minimal loop: DDP, AdamW, random windows of the same text; nothing else."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainer.node.config import ModelConfig
    from trainer.node.data import DataConfig, load_corpus
    from trainer.node.model import GPT

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus(DataConfig(block_size=BLOCK))
    torch.manual_seed(1337)
    model = DistributedDataParallel(GPT(ModelConfig(), vocab_size=len(corpus.vocab), block_size=BLOCK))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.1)
    torch.manual_seed(1337 + rank)
    window = torch.arange(BLOCK + 1)
    started = 0.0
    for step in range(1, steps + 1):
        if step == WARMUP_STEPS + 1:
            started = time.perf_counter()
        starts = torch.randint(len(corpus.ids) - BLOCK - 1, (MICRO_BATCH,))
        chunk = corpus.ids[starts[:, None] + window]
        loss = model(chunk[:, :-1], chunk[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_EVERY == 0:
            loss.item()
    elapsed = time.perf_counter() - started
    tokens = (steps - WARMUP_STEPS) * MICRO_BATCH * BLOCK * world
    if rank == 0:
        print(json.dumps({"tokens_per_s": tokens / elapsed}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--interleaved-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps)
        return 0
    if args.interleaved_worker:
        interleaved_worker(args.steps)
        return 0
    os.environ.pop("RANK", None)
    ratios, trainer_rates, baseline_rates = [], [], []
    with tempfile.TemporaryDirectory(prefix="trainer-bench-") as workdir:
        for round_number in range(1, args.rounds + 1):
            if round_number % 4 in (0, 1):  # A-B, B-A, B-A, A-B
                baseline = baseline_tokens_per_s(args.steps, workdir)
                trainer = trainer_tokens_per_s(args.steps, workdir)
            else:
                trainer = trainer_tokens_per_s(args.steps, workdir)
                baseline = baseline_tokens_per_s(args.steps, workdir)
            ratios.append(trainer / baseline)
            trainer_rates.append(trainer)
            baseline_rates.append(baseline)
            print(
                f"round {round_number}: hand-written DDP {baseline:,.0f} tok/s, "
                f"trainer train {trainer:,.0f} tok/s, ratio {ratios[-1]:.3f}",
                flush=True,
            )
        step_ratio = interleaved_ratio(200, workdir)
    print(
        f"throughput ratio trainer/hand-written = {statistics.geometric_mean(ratios):.3f} (geometric mean of "
        f"{len(ratios)} rounds; median rates {statistics.median(trainer_rates):,.0f} / "
        f"{statistics.median(baseline_rates):,.0f} tok/s; 2 processes, micro batch {MICRO_BATCH} x {BLOCK} "
        "chars; goal >= 0.97)"
    )
    print(
        f"per-step throughput ratio, trainer engine step vs hand-written step interleaved in the same 2 "
        f"processes (immune to machine load) = {step_ratio:.3f} (goal >= 0.97)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
