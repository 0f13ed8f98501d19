"""scripts/testbed/converge_times.py: CI's tail says where the bed's converge spent its time, read from
Molecule's log as Molecule writes it (colour codes, a box character before each line, long task names
wrapped over two lines; the lines below are a real converge's recap)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "testbed" / "converge_times.py"
LOG = """INFO     default \x1b[1m➜\x1b[0m converge: Executing
  \x1b[2m│\x1b[0m TASKS RECAP
  │   ********************************************************************
  │ Friday 27 November 2026  22:20:34 +0000 (0:00:00.128)       0:05:08.722
  │   *******
  │ ============================================================================
  │   ===
  │ trainer_env : Build DeepSpeed's ops as the training user (a stale lock of a
  │   killed build is removed first) - 104.24s
  │ trainer_env : Install torch, the CUDA build on GPU nodes, the CPU build
  │   elsewhere -- 39.96s
  │ trainer_env : Unpack the environment, checked against its source's sha256
  │   (from the shared dir, or this node's own pack) -- 30.97s
  │ trainer_env : Pack the environment on its source node ------------------
  │   11.74s
  │ users : Create the training account ------------------------------- 2.10s
  │ ROLES RECAP
  │ ============================================================================
  │ trainer_env ---------------------------------------------------- 215.10s
  │ users ------------------------------------------------------------ 9.87s
  │ total ---------------------------------------------------------- 240.12s
INFO     default ➜ idempotence: Executing
  │ trainer_env : Install torch, the CUDA build on GPU nodes, the CPU build -- 1.00s
"""


def test_the_tail_names_each_role_and_the_environments_phases(tmp_path):
    log = tmp_path / "molecule.log"
    log.write_text(LOG)
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(log)], capture_output=True, text=True, check=True
    ).stdout
    roles, env = out.splitlines()
    assert roles == "converge by role: trainer_env 215 s, users 10 s"
    phases = "build: DeepSpeed's ops 104 s, build: torch 40 s, unpack 31 s, pack 12 s"
    assert env == f"converge, the node environment: {phases}", "the converge's own seconds, not idempotence's"
