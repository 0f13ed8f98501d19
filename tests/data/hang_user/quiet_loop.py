"""A user's own training loop that goes quiet twice (tests/local/test_hang_local.py): every rank
all-reduces a 1 each step and prints the sum. At step WAIT_STEP every rank sleeps WAIT_S seconds outside
any collective, a wait of the job's own (nobody is where the others are not: nothing to name). At step
HANG_STEP the rank HANG_RANK sleeps for good outside the collective while its peers wait in all_reduce,
having written the time into the file HANG_MARK: the hang's start, for the test."""

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    wait_step, wait_s = int(os.environ.get("WAIT_STEP", "5")), float(os.environ.get("WAIT_S", "70"))
    hang_rank, hang_step = int(os.environ.get("HANG_RANK", "1")), int(os.environ.get("HANG_STEP", "15"))
    for step in range(1, 100_000):
        if step == wait_step:
            print(f"rank {rank}: waiting {wait_s:g} s", flush=True)
            time.sleep(wait_s)
        if rank == hang_rank and step == hang_step:
            with open(os.environ["HANG_MARK"], "w") as mark:
                mark.write(f"{time.time()}\n")
            time.sleep(3600)
        total = torch.ones(1)
        dist.all_reduce(total)
        print(f"rank {rank} step {step}: sum {total.item():.0f}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
