"""Who am I in the job (rank, world, device) and the process group every engine shares.

Works under any launcher that sets the torchrun environment (torchrun, deepspeed, accelerate launch):
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Without a launcher it makes a one-process
group on loopback, so every code path (collectives, checkpoints) is the same as in a real job.
"""

from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any


@dataclass(frozen=True)
class Topology:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    device: str
    backend: str
    hostname: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def world_size_from_env() -> int:
    """The world size the launcher announced (1 without a launcher); needs no torch."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def discover(backend: str = "auto") -> Topology:
    """Read the launcher's environment (filling in a one-process job if there is none)."""
    import torch

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    cuda = torch.cuda.is_available()
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    return Topology(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0"))),
        num_nodes=max(1, world // max(1, local_world)),
        device=f"cuda:{local_rank}" if cuda else "cpu",
        backend=backend,
        hostname=socket.gethostname(),
    )


def start(topology: Topology, timeout_s: int) -> None:
    import torch
    import torch.distributed as dist

    if topology.device.startswith("cuda"):
        torch.cuda.set_device(topology.local_rank)
    elif "OMP_NUM_THREADS" not in os.environ and topology.local_world_size > 1:
        # torchrun sets OMP_NUM_THREADS=1 for several processes per node; other launchers
        # (accelerate launch) do not, and N processes × all cores threads thrash the CPU.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // topology.local_world_size))
    if not dist.is_initialized():
        dist.init_process_group(backend=topology.backend, timeout=timedelta(seconds=timeout_s))


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def mean_across_ranks(value: float, device: str) -> float:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.item() / dist.get_world_size()


def max_across_ranks(value: int, device: str) -> int:
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def gather(obj: Any) -> list[Any]:
    """obj from every rank, in rank order (on every rank)."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def shutdown(clean: bool) -> None:
    """Leave the process group. The barrier first matters: with gloo and 2 nodes × 2 processes,
    destroy_process_group() while a peer is still in a collective can abort a rank and leave the
    other hanging until the timeout. After a failure there is no barrier (peers may be gone)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()
