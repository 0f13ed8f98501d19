"""Check results, the console lines a user reads, and the JSON report a program reads."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.safe_files import umask_mode, write_file

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger(__name__)

PASS = "pass"
FAIL = "fail"
WARN = "warn"
SKIP = "skip"


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
    #: What the SSH check did: mode (sampled or full), logins, tries, retried pairs, most logins per sshd.
    ssh: dict[str, Any] | None = None
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
            "ssh": self.ssh,
        }

    def write(self, path: Path) -> None:
        """Write atomically, so a reader never sees half a report; the measured bandwidth matrix also as
        a PNG heatmap beside it (`<report>-bandwidth.png`, named in the JSON as bandwidth.heatmap)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if self.bandwidth and any(v is not None for row in self.bandwidth["matrix"] for v in row):
            picture = heatmap_path(path)
            try:
                write_png(bandwidth_heatmap(self.bandwidth), picture)
                self.bandwidth["heatmap"] = picture.name
            except Exception as err:  # a picture that cannot be drawn never costs the verdicts
                log.warning("bandwidth heatmap not written to %s: %s: %s", picture, type(err).__name__, err)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")
        os.replace(tmp, path)


def heatmap_path(report_path: Path) -> Path:
    return report_path.with_name(f"{report_path.stem}-bandwidth.png")


def bandwidth_heatmap(bandwidth: dict[str, Any]) -> Figure:
    """The bandwidth matrix as a heatmap (rows = sender, columns = receiver, Gbit/s in each cell;
    the diagonal and unmeasured cells blank), on its own Figure: no pyplot, nothing shown."""
    from matplotlib.figure import Figure

    nodes, cells = bandwidth["nodes"], bandwidth["matrix"]
    values = [[math.nan if v is None else float(v) for v in row] for row in cells]
    side = min(20.0, 3.0 + 0.9 * len(nodes))
    fig = Figure(figsize=(side + 1.5, side), dpi=100, layout="constrained")
    axes = fig.add_subplot()
    image = axes.imshow(values, cmap="viridis", vmin=0.0)
    fig.colorbar(image, ax=axes, label="Gbit/s")
    axes.set_xticks(range(len(nodes)), nodes, rotation=45, ha="right")
    axes.set_yticks(range(len(nodes)), nodes)
    axes.set_xlabel("receiver")
    axes.set_ylabel("sender")
    threshold = bandwidth.get("threshold_gbit")
    axes.set_title("iperf3 bandwidth" + (f" (warn below {threshold:g} Gbit/s)" if threshold else ""))
    if len(nodes) <= 16:  # the numbers stay readable
        finite = [v for row in values for v in row if not math.isnan(v)]
        middle = (max(finite) + min(finite)) / 2 if finite else 0.0
        for i, row in enumerate(values):
            for j, value in enumerate(row):
                if not math.isnan(value):
                    color = "black" if value > middle else "white"
                    axes.text(j, i, f"{value:.2f}", ha="center", va="center", color=color, fontsize=8)
    return fig


def write_png(fig: Figure, path: Path) -> None:
    """Through matplotlib's Agg canvas, into memory, then written whole without following a link: the
    report may sit in a dir another account can write (the shared dir), where a link planted under the
    temporary name would have made savefig overwrite whatever it points at, as the operator."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    picture = io.BytesIO()
    fig.savefig(picture, format="png")
    write_file(path, picture.getvalue(), umask_mode())


def format_result(result: Result) -> str:
    """One line per verdict, the fix on an indented line below a failure or warning."""
    detail = result.detail.replace("\n", "\n      ")  # keep a quoted log tail under its verdict
    line = f"{result.status.upper():<4}  {result.check:<13} {result.subject:<28} {detail}"
    if result.fix and result.status in (FAIL, WARN):
        line += f"\n      fix: {result.fix}"
    return line
