"""torch's flight recorder read back inside a rank: the last collective it entered, per process group.

Under `trainer launch`, run.sh sets TORCH_FR_BUFFER_SIZE (torch then records each collective a rank
enters, gloo's as NCCL's, in a ring buffer), and NCCL writes that buffer to the launch's
flight-recorder dir (RunPaths.flight_recorder) when a collective times out. A rank of the bundled
trainer whose step lasts reads its own buffer (progress.py, every BUSY_SAMPLE_S) and writes, per
process group, the sequence number of the last collective it entered, the last one that ended, and its
name. The launcher compares the ranks' numbers at a stall (launcher/hang.py): the rank that never
entered the collective its peers wait in is named, even where every rank is in the same step. The dump
is torch's JSON form (nothing unpickled), built in this process from its own memory.
"""

from __future__ import annotations

import json
import os
from typing import Any

#: torch's variable: the ring buffer's size in entries (0 or unset: no recorder).
BUFFER_VARIABLE = "TORCH_FR_BUFFER_SIZE"


def enabled() -> bool:
    try:
        return int(os.environ.get(BUFFER_VARIABLE, "0")) > 0
    except ValueError:
        return False


def last_collectives() -> dict[str, dict[str, Any]] | None:
    """{process group id: {"group": its name, "entered": the last collective's sequence number it
    entered, "ended": the last that ended, "op": the last entered's name (`all_reduce`)}}, or None
    where no recorder runs (not enabled, no process group, a torch without it). Called from a thread
    other than the training one, while that one may wait in a collective: torch's recorder holds its
    own lock."""
    if not enabled():
        return None
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        from torch._C._distributed_c10d import _dump_fr_trace_json

        dump = json.loads(_dump_fr_trace_json(True, False))
    except Exception:  # a torch without the recorder, or a dump it could not build
        return None
    return summarize(dump)


def summarize(dump: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The per-group summary of one rank's dump (torch's JSON form: `pg_status` per group id, `entries`
    each with `pg_id`, `process_group` [name, description], `collective_seq_id`, `profiling_name`
    such as `gloo:all_reduce` or `nccl:broadcast`)."""
    status = dump.get("pg_status")
    if not isinstance(status, dict):
        return None
    last: dict[str, dict[str, Any]] = {}  # group id -> the last collective it recorded
    for entry in dump.get("entries") or []:
        if isinstance(entry, dict) and not entry.get("is_p2p"):
            last[str(entry.get("pg_id"))] = entry
    summary = {}
    for pg_id, counts in status.items():
        try:
            entered = int(counts["last_enqueued_collective"])
            ended = int(counts["last_completed_collective"])
        except (KeyError, TypeError, ValueError):
            continue
        if entered < 0:
            continue  # a group this rank never used
        entry = last.get(str(pg_id), {})
        op = str(entry.get("profiling_name", "")).split(":", 1)[-1]
        summary[str(pg_id)] = {
            "group": _group_name(entry.get("process_group")),
            "entered": entered,
            "ended": ended,
            "op": op if str(entry.get("collective_seq_id")) == str(entered) else "",
        }
    return summary or None


def _group_name(group: Any) -> str:
    """An entry's `process_group`, [name, description]: the description where torch has one
    (`default_pg`), else the name (DeepSpeed's groups are `undefined`)."""
    if not isinstance(group, list) or len(group) != 2:
        return ""
    name, description = map(str, group)
    return description if description not in ("", "undefined") else name
