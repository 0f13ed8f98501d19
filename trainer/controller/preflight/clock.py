"""Clock offsets against the head, measured rather than trusted to chrony.

Each worker sends timestamped requests to a listener on the head. For one request sent at t0 and
answered at t1 (worker clock) with the head's time th, the worker's clock is ahead of the head's by
(t0 + t1) / 2 - th, wrong by at most half the round trip; the smallest round trip is the tightest.
"""

from __future__ import annotations

from trainer.controller.preflight.report import FAIL, PASS, Result

CHECK = "clock"


def best_offset(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(this node's clock minus the head's, round trip) from the minimum-RTT sample.

    Each sample is (sent, head_time, received), the first and last on this node's clock.
    """
    if not samples:
        raise ValueError("no clock samples")
    sent, head_time, received = min(samples, key=lambda s: s[2] - s[0])
    return (sent + received) / 2 - head_time, received - sent


def evaluate(host: str, head: str, node_minus_head_s: float, rtt_s: float, bound_s: float) -> Result:
    """Pass when |offset| + the measurement's own uncertainty (RTT/2) stays within the bound."""
    data = {"offset_s": node_minus_head_s, "rtt_s": rtt_s, "bound_s": bound_s}
    shown = f"{node_minus_head_s:+.3f} s against {head} (±{rtt_s / 2 * 1000:.1f} ms)"
    if abs(node_minus_head_s) + rtt_s / 2 > bound_s:
        return Result(
            CHECK,
            host,
            FAIL,
            f"clock of {host} is {node_minus_head_s:+.3f} s off {head}'s, beyond the {bound_s:g} s bound",
            fix=f"sync {host} to the head's time server: check `chronyc sources` on {host} shows the head "
            f"with ^*, then `chronyc makestep` (re-run the time sync role: make provision)",
            data=data,
        )
    return Result(CHECK, host, PASS, shown, data=data)
