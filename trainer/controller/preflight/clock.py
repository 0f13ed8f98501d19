"""Clock offsets against the head, measured rather than trusted to chrony, and chronyd's own state.

Each worker sends timestamped requests to a listener on the head. For one request sent at t0 and
answered at t1 (worker clock) with the head's time th, the worker's clock is ahead of the head's by
(t0 + t1) / 2 - th, wrong by at most half the round trip; the smallest round trip is the tightest.
"""

from __future__ import annotations

from trainer.controller.preflight.report import FAIL, PASS, WARN, Result

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


def chrony_verdict(
    host: str, chrony: dict | None, head: str, head_address: str, is_head: bool
) -> tuple[str, str, str]:
    """(status, what chronyd says, fix) from `chronyc -n tracking` on `host`.

    A clock within the bound today drifts past it tomorrow if chronyd is stopped or follows
    nothing, so "running and synchronised" is checked besides the measured offset. The head
    follows its upstream servers or serves its own clock (local stratum); a worker follows the head.
    """
    timesync = "ansible-playbook site.yml --tags timesync"
    if not chrony:
        return (
            FAIL,
            f"could not ask chronyd on {host}",
            f"on {host}: chronyc -n tracking must answer ({timesync})",
        )
    if not chrony.get("running"):
        error = str(chrony.get("error") or "no answer")
        if chrony.get("rc") == 127:
            return (
                FAIL,
                f"chrony is not installed on {host}",
                f"install and configure it on {host}: {timesync} (apt-get install chrony)",
            )
        return (
            FAIL,
            f"chronyd is not running on {host} (chronyc: {error})",
            f"on {host}: systemctl enable --now chrony; chronyc -n tracking must then name "
            + ("its time source" if is_head else f"{head} ({head_address})")
            + f" ({timesync} sets it up)",
        )
    tracking = chrony.get("tracking") or {}
    reference = tracking.get("Reference ID", "?")
    leap = tracking.get("Leap status", "?")
    stratum = tracking.get("Stratum", "?")
    offset = tracking.get("System time", "")
    if leap.lower().startswith("not synchronised") or reference.startswith("00000000"):
        if is_head:
            fix = (
                f"on {host}: chronyc -n sources must show a reachable upstream with ^*, or, without "
                f"upstream servers, `local stratum` must be in chrony's config ({timesync}); then "
                "systemctl restart chrony"
            )
        else:
            fix = (
                f"on {host}: chronyc -n sources must show {head_address} with ^*; check that chronyd "
                f"runs on {head} and that ufw on {head} allows 123/udp from {host} ({timesync}), then "
                f"chronyc makestep on {host}"
            )
        return FAIL, f"chronyd on {host} is not synchronised (reference {reference}, leap status {leap})", fix
    shown = f"chronyd synchronised to {reference}, stratum {stratum}" + (f", {offset}" if offset else "")
    if not is_head and head_address not in reference:
        return (
            WARN,
            f"{shown}: it follows {reference}, not the head {head} ({head_address})",
            f"point chronyd on {host} at the head ({timesync}), so every node follows one clock",
        )
    return PASS, shown, ""
