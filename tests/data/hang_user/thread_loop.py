"""A user's own training loop whose rank waits on a thread of its own that is stuck (tests of
launcher/hang.py): every rank all-reduces a 1 each step; at step HANG_STEP the rank HANG_RANK hands
the next batch to a loader thread and waits for it, and the loader sleeps for ever (as a read from a
stalled store would). Its main thread waits in threading's join while its peers wait in all_reduce."""

import os
import threading
import time

import torch
import torch.distributed as dist


def load_batch() -> None:
    time.sleep(3600)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hang_rank, hang_step = int(os.environ.get("HANG_RANK", "1")), int(os.environ.get("HANG_STEP", "5"))
    for step in range(1, 100_000):
        if rank == hang_rank and step == hang_step:
            loader = threading.Thread(target=load_batch, name="loader")
            loader.start()
            loader.join()
        total = torch.ones(1)
        dist.all_reduce(total)
        print(f"rank {rank} step {step}: sum {total.item():.0f}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
