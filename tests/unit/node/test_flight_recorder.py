"""torch's flight recorder read back inside a rank (trainer/node/flight_recorder.py), on two real gloo
processes: rank 1 stops after three all_reduces, rank 0 waits in the fourth. Each reads its own recorder
from another thread while its main one waits, as the progress writer does; the launcher's flight_hang
then names rank 1, which never entered the collective rank 0 waits in (issue 39)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from trainer.controller.launcher.hang import RankState, flight_hang

RANK_SCRIPT = """
import json, sys, threading, time
import torch, torch.distributed as dist
from trainer.node.flight_recorder import last_collectives
dist.init_process_group("gloo")
rank, t = dist.get_rank(), torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
def report():
    time.sleep(1.5)  # rank 0 waits in its fourth all_reduce by now
    print(json.dumps(last_collectives()), flush=True)
    if rank == 1:
        dist.all_reduce(t)  # lets rank 0 go
reader = threading.Thread(target=report)
reader.start()
if rank == 0:
    dist.all_reduce(t)
reader.join()
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(buffer_size: str) -> dict[int, dict | None]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    env["TORCH_FR_BUFFER_SIZE"] = buffer_size
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT],
            env=dict(env, RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    said = {}
    for rank, proc in enumerate(ranks):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        said[rank] = json.loads(out.strip().splitlines()[-1])
    return said


def test_each_rank_reports_its_last_collective_and_the_one_that_never_entered_is_named():
    said = run_ranks("200")
    default = {rank: summary["0"] for rank, summary in said.items()}
    assert default[0] == {"group": "default_pg", "entered": 4, "ended": 3, "op": "all_reduce"}, said
    assert default[1] == {"group": "default_pg", "entered": 3, "ended": 3, "op": "all_reduce"}, said
    states = [RankState("node0", 0, 0, 100, "S"), RankState("node1", 1, 1, 200, "S")]
    records = {("node0", 0): {"collectives": said[0]}, ("node1", 1): {"collectives": said[1]}}
    hang = flight_hang(states, records)
    assert hang is not None and hang.culprit.rank == 1, hang
    assert hang.culprit_text == (
        "not in the collective its peers wait in (all_reduce #4): its last collective: all_reduce #3, "
        "ended — sleeping — state S"
    )
    assert hang.consequence_text(states[0]) == "waiting in all_reduce #4 (sleeping — state S)"


def test_without_the_recorder_nothing_is_reported_and_nothing_named():
    said = run_ranks("0")
    assert said == {0: None, 1: None}
    states = [RankState("node0", 0, 0, 100, "S"), RankState("node1", 1, 1, 200, "S")]
    assert flight_hang(states, {("node0", 0): {"collectives": None}, ("node1", 1): {}}) is None
