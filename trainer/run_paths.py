"""Every path of a run, in one value: `<shared dir>/runs/<run name>/` holds the trainer's output and
checkpoints, and `launch/` the launcher's files and each node's `node-<rank>/` (run.sh, log, pid).

Both sides use it (standard library only): the controller to say where a launch writes, the node to
find its checkpoints. The launcher's node helper (playbooks/files/node_ctl.py) is sent to the nodes as
text and imports nothing of this package: it keeps its own few names, and a unit test ties them here.

A RunPaths keeps the kind of path it is made with: the controller's PurePosixPath (the nodes' paths,
never this machine's), the node's Path (to open).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath, PurePosixPath

RUNS = "runs"
LAUNCH = "launch"
CHECKPOINTS = "checkpoints"
#: Names the newest complete checkpoint (`step-N`) in the checkpoints dir.
LATEST = "latest"
HISTORY = "history.jsonl"
LOCK = "lock"


@dataclass(frozen=True)
class RunPaths:
    run_dir: PurePath
    """`<shared dir>/runs/<run name>`: the trainer's output_dir."""

    @classmethod
    def of(cls, shared_dir: str | PurePath, run_name: str) -> RunPaths:
        """The run `run_name` on the cluster's shared dir, as the nodes see it."""
        return cls(PurePosixPath(shared_dir) / RUNS / run_name)

    @property
    def runs_dir(self) -> PurePath:
        """Where every run of the shared dir lies."""
        return self.run_dir.parent

    @property
    def launch_dir(self) -> PurePath:
        """The launcher's files for the run: config, DeepSpeed JSON, hostfile, the node dirs."""
        return self.run_dir / LAUNCH

    def node_dir(self, rank: int | str) -> PurePath:
        """Node `rank`'s files of the latest launch (`N` for the pattern that names them all)."""
        return self.launch_dir / f"node-{rank}"

    def node_log(self, rank: int | str) -> PurePath:
        return self.node_dir(rank) / "log"

    def torchrun_log_dir(self, rank: int | str) -> PurePath:
        """torchrun's --log-dir: each rank's error file, for the root cause of a failure."""
        return self.node_dir(rank) / "torchrun"

    @property
    def flight_recorder(self) -> PurePath:
        """torch's flight recorder dumps: `<launch id>/rank_<R>` beneath, every rank's of one launch in
        one dir (NCCL writes them when a collective times out; `torchfrtrace` reads such a dir)."""
        return self.launch_dir / "flight-recorder"

    @property
    def history(self) -> PurePath:
        """The run's launches, restarts and stops, one JSON record a line (written on the head)."""
        return self.launch_dir / HISTORY

    @property
    def lock(self) -> PurePath:
        """The run's lock on the head: one launcher per run name."""
        return self.launch_dir / LOCK

    @property
    def checkpoints(self) -> PurePath:
        return self.run_dir / CHECKPOINTS

    @property
    def latest(self) -> PurePath:
        """The file naming the newest complete checkpoint."""
        return self.checkpoints / LATEST
