"""How long the bundled trainer may go without a rank advancing before the launcher calls it a hang.

A fixed --stall-timeout has to be long enough for the slowest step of any job (600 s by default), so a
rank stuck outside a collective went unnamed for ten minutes. Without --stall-timeout the bound adapts
to the job: once the ranks' progress records say how long their steps take (the slowest step after
the first, trainer.node.progress), a hang is STALL_STEP_FACTOR times that slowest step, and never
under STALL_FLOOR_S (a short step on a busy machine jitters). Before the steps' times are known
(loading the model, building DeepSpeed's ops, the first compile) and while a rank announces an
evaluation or a checkpoint save, the ceiling holds: the old fixed bound, so none of those is taken
for a hang. With --stall-timeout S the bound is S, whatever the steps take.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

#: The adaptive bound's floor, in seconds.
STALL_FLOOR_S = 60.0
#: The adaptive bound, in slowest steps.
STALL_STEP_FACTOR = 4.0


def _seconds(value: Any) -> float | None:
    """A finite, positive number of seconds from a record the training account wrote; else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


def stall_bound(records: Iterable[dict[str, Any]], ceiling: float, adaptive: bool) -> tuple[float, str]:
    """(seconds without a rank advancing that make a stall, what the bound rests on for the report: ""
    for a fixed --stall-timeout, which the report names itself)."""
    if not adaptive:
        return ceiling, ""
    records = list(records)
    paused = sorted({str(r.get("phase")) for r in records if r.get("phase") not in (None, "train")})
    if paused:
        return ceiling, f"an announced {' and '.join(paused)}: the ceiling, {ceiling:g} s"
    slowest = max((s for r in records if (s := _seconds(r.get("slowest_step_s"))) is not None), default=None)
    if slowest is None:
        return ceiling, f"before the steps' times are known: the ceiling, {ceiling:g} s"
    bound = min(ceiling, max(STALL_FLOOR_S, STALL_STEP_FACTOR * slowest))
    return bound, (
        f"{STALL_STEP_FACTOR:g} × the slowest step ({slowest:.1f} s), at least {STALL_FLOOR_S:g} s, "
        f"at most {ceiling:g} s"
    )
