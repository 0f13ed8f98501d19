"""How long the bundled trainer may go without a rank advancing before the launcher calls it a hang.

A fixed --stall-timeout has to be long enough for the slowest step of any job (600 s by default), so a
rank stuck outside a collective went unnamed for ten minutes. Without --stall-timeout the bound adapts
to the job: once the ranks' progress records say how long their steps take (the slowest step after
the first, trainer.node.progress), a hang is STALL_STEP_FACTOR times that slowest step, and never
under STALL_FLOOR_S (a short step on a busy machine jitters). Before the steps' times are known
(loading the model, building DeepSpeed's ops, the first compile) and while a rank announces an
evaluation or a checkpoint save, the ceiling holds: the old fixed bound, so none of those is taken
for a hang. The ceiling holds too while a rank computes a step that lasts (its training thread on a
CPU, trainer.node.progress's `busy_share`): a legitimately slow step (a long sequence, a step that
takes 90 s on purpose) is not a hang, where a rank that sleeps outside its collective, or waits in one,
or is stopped, computes nothing. On a GPU a rank waiting for its GPU spins on its CPU, so there every
rank must be computing. With --stall-timeout S the bound is S, whatever the steps take.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

#: The adaptive bound's floor, in seconds.
STALL_FLOOR_S = 60.0
#: The adaptive bound, in slowest steps.
STALL_STEP_FACTOR = 4.0
#: A rank whose training thread was on a CPU for at least this share of a sample computes. One that
#: sleeps or waits in a gloo collective is near 0; one computing on a busy machine (four ranks on two
#: cores in the tests) still gets a good part of a core.
COMPUTING_SHARE = 0.2
#: A rank's sample older than this by the launcher's clock no longer counts: a rank writes one every
#: BUSY_SAMPLE_S (5 s) while a step lasts, a stopped or vanished one none.
COMPUTING_FRESH_S = 20.0


def _seconds(value: Any) -> float | None:
    """A finite, positive number of seconds from a record the training account wrote; else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


#: A user's command: a rank that read or wrote this many bytes a second (files, sockets, its output)
#: works. One waiting in a collective moves none; a stray thread's heartbeat far fewer.
ACTIVE_IO_BPS = 64 * 1024


def used_time_or_io(activity: dict[str, Any]) -> bool:
    """Whether a node's `activity` (node_ctl.activity: what each rank used during one quiet poll) shows
    a rank working: on a CPU for COMPUTING_SHARE of the time, or moving ACTIVE_IO_BPS. Processes with
    no rank (torchrun's agent, a shell) count only where no process has one."""
    seconds, ranks = activity.get("seconds"), activity.get("ranks")
    if not isinstance(seconds, int | float) or seconds <= 0 or not isinstance(ranks, dict):
        return False
    counted = {r: v for r, v in ranks.items() if r != ""} or ranks
    for used in counted.values():
        if not isinstance(used, list) or len(used) != 2:
            continue
        cpu, moved = used
        if isinstance(cpu, int | float) and cpu / seconds >= COMPUTING_SHARE:
            return True
        if isinstance(moved, int) and moved / seconds >= ACTIVE_IO_BPS:
            return True
    return False


def busy(record: dict[str, Any]) -> bool:
    """Whether a rank's record says its training thread computes (a sample at COMPUTING_SHARE or more)."""
    share = record.get("busy_share")
    return isinstance(share, int | float) and not isinstance(share, bool) and share >= COMPUTING_SHARE


def computing_text(records: Sequence[dict[str, Any]], computing: Sequence[str]) -> str:
    """Why the step is taken as being computed, not hung: `rank 1 on node1 computing its step`; '' where
    it is not. `computing`: the ranks with a fresh busy sample (the launcher's clock), of `records`, every
    rank's last record. On the CPU one is enough (its peers wait asleep); where a rank trains on a GPU,
    every rank must be (a rank waiting for its GPU or a collective spins on its CPU)."""
    if not computing:
        return ""
    on_gpu = any(str(r.get("device", "")).startswith("cuda") for r in records)
    if on_gpu and len(computing) < len(records):
        return ""
    shown = ", ".join(computing[:3]) + (f" and {len(computing) - 3} more" if len(computing) > 3 else "")
    return f"{shown} computing {'their' if len(computing) > 1 else 'its'} step (its training thread on a CPU)"


def stall_bound(
    records: Iterable[dict[str, Any]], ceiling: float, adaptive: bool, computing: Sequence[str] = ()
) -> tuple[float, str]:
    """(seconds without a rank advancing that make a stall, what the bound rests on for the report: ""
    for a fixed --stall-timeout, which the report names itself). `computing`: the ranks whose fresh
    sample says they compute (computing_text)."""
    if not adaptive:
        return ceiling, ""
    records = list(records)
    paused = sorted({str(r.get("phase")) for r in records if r.get("phase") not in (None, "train")})
    if paused:
        return ceiling, f"an announced {' and '.join(paused)}: the ceiling, {ceiling:g} s"
    if held := computing_text(records, computing):
        return ceiling, f"{held}: the ceiling, {ceiling:g} s"
    slowest = max((s for r in records if (s := _seconds(r.get("slowest_step_s"))) is not None), default=None)
    if slowest is None:
        return ceiling, f"before the steps' times are known: the ceiling, {ceiling:g} s"
    bound = min(ceiling, max(STALL_FLOOR_S, STALL_STEP_FACTOR * slowest))
    return bound, (
        f"{STALL_STEP_FACTOR:g} × the slowest step ({slowest:.1f} s), at least {STALL_FLOOR_S:g} s, "
        f"at most {ceiling:g} s"
    )
