"""A user's own training loop whose ranks take different paths (tests/local/test_hang_local.py): every
rank all-reduces a 1 each step; at step HANG_STEP the rank HANG_RANK calls all_gather instead, so it
waits for peers that never gather while they wait in all_reduce for it (gloo: for ever). Just before,
it writes the time into the file HANG_MARK: the hang's start, for the test."""

import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hang_rank, hang_step = int(os.environ.get("HANG_RANK", "1")), int(os.environ.get("HANG_STEP", "5"))
    for step in range(1, 100_000):
        total = torch.ones(1)
        if rank == hang_rank and step == hang_step:
            with open(os.environ["HANG_MARK"], "w") as mark:
                mark.write(f"{time.time()}\n")
            dist.all_gather([torch.zeros(1) for _ in range(world)], total)
        else:
            dist.all_reduce(total)
        print(f"rank {rank} step {step}: sum {total.item():.0f}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main()
