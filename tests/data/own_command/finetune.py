"""A tiny training script of the tests' own, in the place of Qwen's finetune.py: torchrun starts it
(from finetune/finetune_lora_ds.sh), it takes the same command-line shape, trains a linear model with
DDP over gloo and saves a checkpoint every --save_steps (resuming from the latest one). Rank 0
writes <output_dir>/result.json with what every rank saw: its node's environment, the DeepSpeed
JSON and accelerate config the launcher generated, and its final parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--data_path", required=True)
    parser.add_argument("--bf16", default="False")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=6)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=0.03)
    parser.add_argument("--save_steps", type=int, default=3)
    parser.add_argument("--deepspeed", default="")
    return parser.parse_args()


def latest_checkpoint(output_dir: Path) -> Path | None:
    steps = sorted(
        (int(p.name.removeprefix("checkpoint-")), p)
        for p in output_dir.glob("checkpoint-*")
        if (p / "state.pt").exists()
    )
    return steps[-1][1] if steps else None


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    output_dir = Path(args.output_dir)
    samples = json.loads(Path(args.data_path).read_text())
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.learning_rate)
    start = 0
    resumed = latest_checkpoint(output_dir)
    if resumed is not None:
        state = torch.load(resumed / "state.pt")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
    ddp = DistributedDataParallel(model)
    loss = torch.tensor(0.0)
    for step in range(start + 1, args.max_steps + 1):
        batch = [
            samples[(step * world + rank + i) % len(samples)] for i in range(args.per_device_train_batch_size)
        ]
        x = torch.tensor([[s[0]] for s in batch])
        y = torch.tensor([[s[1]] for s in batch])
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if rank == 0:
            print(f"[Rank 0] {{'loss': {loss.item():.4f}, 'step': {step}}}", flush=True)
            if step % args.save_steps == 0 or step == args.max_steps:
                target = output_dir / f"checkpoint-{step}"
                target.mkdir(parents=True, exist_ok=True)
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
                torch.save(state, target / "state.pt")
    deepspeed = json.loads(Path(os.environ["DEEPSPEED_CONFIG"]).read_text())
    accelerate = yaml.safe_load(Path(os.environ["ACCELERATE_CONFIG_FILE"]).read_text())
    seen = {
        "rank": rank,
        "hostname": socket.gethostname(),
        "cwd": os.getcwd(),
        "env": {
            name: os.environ.get(name)
            for name in (
                "NNODES",
                "NODE_RANK",
                "MASTER_ADDR",
                "MASTER_PORT",
                "GPUS_PER_NODE",
                "WORLD_SIZE",
                "NCCL_IB_DISABLE",
                "NCCL_SOCKET_IFNAME",
                "CLUSTER_OUTPUT_DIR",
                "DEEPSPEED_CONFIG",
                "ACCELERATE_CONFIG_FILE",
                "HF_HOME",
            )
        },
        "deepspeed_arg": args.deepspeed,
        "deepspeed_zero_stage": deepspeed["zero_optimization"]["stage"],
        "accelerate_machine_rank": accelerate["machine_rank"],
        "params": [round(p.item(), 6) for p in model.parameters()],
        "final_loss": loss.item(),
        "resumed_from": resumed.name if resumed else None,
    }
    gathered: list = [None] * world
    dist.all_gather_object(gathered, seen)
    if rank == 0:
        (output_dir / "result.json").write_text(
            json.dumps({"world_size": world, "ranks": gathered}, indent=2)
        )
    # Every rank past its last collective, then out without gloo's teardown: torch 2.13's gloo under a
    # static rendezvous (this script's, as Qwen's) sometimes aborts a rank in it ("terminate called
    # without an active exception", exit 134; TESTBED.md), barrier or not (seen on the bed's worker1
    # after the last step, 2026-11-29). The work is done and saved: nothing is lost by not tearing down.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
