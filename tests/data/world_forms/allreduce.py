"""A user's own distributed script, the smallest one: join the job torch.distributed's environment
describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from whatever launcher started it), all-reduce a
1, and write what this rank saw to results/rank-RANK-HOST.json in the working directory. With one job
of N processes every rank sees world size N and a sum of N; with separate jobs each sees its own.

HOLD_S=S in the environment: stay S seconds after the all-reduce (the launcher's world check looks
while the job runs). Arguments (deepspeed's --local_rank) are ignored.
"""

import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
total = torch.ones(1, device="cuda" if torch.cuda.is_available() else "cpu")
dist.all_reduce(total)
seen = {
    "rank": dist.get_rank(),
    "world_size": dist.get_world_size(),
    "sum": int(total.item()),
    "node_rank": os.environ.get("NODE_RANK"),
    "hostname": socket.gethostname(),
}
results = Path("results")
results.mkdir(exist_ok=True)
(results / f"rank-{seen['rank']}-{seen['hostname']}.json").write_text(json.dumps(seen))
print(f"rank {seen['rank']} of {seen['world_size']}: all-reduce sum {seen['sum']}", flush=True)
time.sleep(float(os.environ.get("HOLD_S", "0")))
dist.barrier()
dist.destroy_process_group()
