"""Check results, the console lines a user reads, and the JSON report a program reads."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PASS = "pass"
FAIL = "fail"
WARN = "warn"
SKIP = "skip"

#: Every check family in run order; these names are what `--skip` takes. All but the last run in
#: the probe pass (one playbook, seconds); `deepspeed` starts a real job afterwards.
CHECKS: tuple[str, ...] = (
    "topology",
    "ssh",
    "master_port",
    "ufw",
    "interface",
    "accelerators",
    "versions",
    "interconnect",
    "deepspeed_ops",
    "clock",
    "nfs",
    "shared_dir",
    "space",
    "data",
    "bandwidth",
    "deepspeed",
)


@dataclass
class Result:
    """One verdict about one host or one pair of hosts."""

    check: str
    subject: str
    status: str
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


def skipped(check: str, reason: str, subject: str = "cluster") -> Result:
    return Result(check, subject, SKIP, reason)


@dataclass
class Report:
    inventory: str
    results: list[Result] = field(default_factory=list)
    #: The bandwidth matrix (Gbit/s), rows = sender, columns = receiver; None when not measured.
    bandwidth: dict[str, Any] | None = None
    duration_s: float = 0.0
    #: Wall time of the probe pass (topology and the probe playbook), before the DeepSpeed job.
    probe_duration_s: float = 0.0

    def add(self, results: list[Result]) -> None:
        self.results.extend(results)

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status == FAIL]

    @property
    def ok(self) -> bool:
        return not self.failed

    def summary(self) -> dict[str, dict[str, int]]:
        counts: dict[str, dict[str, int]] = {}
        for result in self.results:
            per_check = counts.setdefault(result.check, {PASS: 0, FAIL: 0, WARN: 0, SKIP: 0})
            per_check[result.status] += 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "inventory": self.inventory,
            "ok": self.ok,
            "duration_s": round(self.duration_s, 2),
            "probe_duration_s": round(self.probe_duration_s, 2),
            "summary": self.summary(),
            "results": [asdict(r) for r in self.results],
            "bandwidth": self.bandwidth,
        }

    def write(self, path: Path) -> None:
        """Write atomically, so a reader never sees half a report."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")
        os.replace(tmp, path)


def format_result(result: Result) -> str:
    """One line per verdict, the fix on an indented line below a failure or warning."""
    detail = result.detail.replace("\n", "\n      ")  # keep a quoted log tail under its verdict
    line = f"{result.status.upper():<4}  {result.check:<13} {result.subject:<28} {detail}"
    if result.fix and result.status in (FAIL, WARN):
        line += f"\n      fix: {result.fix}"
    return line
