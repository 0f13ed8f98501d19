"""A user's own training loop that hangs (tests/local/test_hang_local.py): every rank all-reduces a 1
each step and prints the sum; at step HANG_STEP the rank HANG_RANK stops taking part. HANG=sleep: it
sleeps outside the collective while its peers wait in all_reduce; HANG=stop: it stops itself with
SIGSTOP. Just before, it writes the time into the file HANG_MARK: the hang's start, for the test."""

import os
import signal
import time

import torch
import torch.distributed as dist


def hang(kind: str) -> None:
    with open(os.environ["HANG_MARK"], "w") as mark:
        mark.write(f"{time.time()}\n")
    print(f"rank {dist.get_rank()}: {kind} now", flush=True)
    if kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hang_rank, hang_step = int(os.environ.get("HANG_RANK", "1")), int(os.environ.get("HANG_STEP", "5"))
    for step in range(1, 100_000):
        if rank == hang_rank and step == hang_step:
            hang(os.environ.get("HANG", "sleep"))
        total = torch.ones(1)
        dist.all_reduce(total)
        print(f"rank {rank} step {step}: sum {total.item():.0f}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
