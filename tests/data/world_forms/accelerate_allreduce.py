"""A user's accelerate script as most are written: Accelerator() with no cpu=True, even on CPU nodes.
Writes what each process saw (accelerate's distributed type, process count, the all-reduced 1) to
results/rank-INDEX-HOST.json in the working directory; HOLD_S=S: stay S seconds after it."""

import json
import os
import socket
import time
from pathlib import Path

import torch
from accelerate import Accelerator

accelerator = Accelerator()
total = accelerator.reduce(torch.ones(1, device=accelerator.device), reduction="sum")
seen = {
    "rank": accelerator.process_index,
    "world_size": accelerator.num_processes,
    "sum": int(total.item()),
    "distributed_type": str(accelerator.distributed_type),
    "hostname": socket.gethostname(),
}
results = Path("results")
results.mkdir(exist_ok=True)
(results / f"rank-{seen['rank']}-{seen['hostname']}.json").write_text(json.dumps(seen))
kind, size = seen["distributed_type"], seen["world_size"]
print(f"process {seen['rank']} of {size} ({kind}): sum {seen['sum']}", flush=True)
time.sleep(float(os.environ.get("HOLD_S", "0")))
accelerator.wait_for_everyone()
