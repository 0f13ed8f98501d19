"""Hangs injected for real, on two loopback "hosts" or on the test bed: seconds from the injection to
the culprit named.

Per kind, one `trainer launch --stall-timeout S` on the loopback cluster (tests/helpers/loopback.py:
node0 and node1 are this machine, one process each) or, with --bed, on the Molecule test bed (ct-head,
ct-worker1, ct-worker2: three containers reached over SSH, one process each), a hang injected into node
1's rank (node1, ct-worker1) once the run trains, and from the launcher's output, stamped as it arrives:
- `detected`: seconds from the injection to the stall watchdog's line (`stalled (...): collecting`);
- `named`: seconds to the line naming the culprit (`culprit: ...`, printed once every node's ranks'
  process states are read, before the stacks and the stop), or where none is printed to the report's
  first line (`hung: ...`, or `stalled: ...` with the ranks behind);
- `reported`: seconds to that report's first line, after every node was stopped;
- what was named (that line), and the launcher's exit code (71 HUNG, 1 a stall without a culprit).

Kinds:
- `sigstop`: the bundled trainer (ddp), node1's rank stopped with SIGSTOP at step 4 or later;
- `sleep`: the bundled trainer, node1's rank sleeping outside a collective before step 6
  (`TRAINER_TEST_STALL=1:6`), injected when its record of step 5 done was written;
- `stuck-in-step`: the bundled trainer, node1's rank sleeping once it started step 6, before the step's
  collectives (`TRAINER_TEST_STALL_IN=1:6`: every rank's record says step 6; named by torch's flight
  recorder), injected when its record of step 6 started was written;
- `torchrun-sigstop`: your own command, `torchrun` of tests/data/hang_user/allreduce_loop.py (an
  all-reduce and a line a step, no progress files), node1's rank stopping itself with SIGSTOP at step 20;
- `torchrun-sleep`: the same, node1's rank sleeping outside the collective from step 20 (named by the
  ranks' py-spy stacks);
- `torchrun-diverged`: your own command, tests/data/hang_user/diverged_loop.py on two ranks per node,
  rank 1 calling all_gather at step 20 where the other three all_reduce (named by the stacks);
- `dstate`: your own command, node1's process reading a file of a FUSE mount that never answers
  (state D, as on a hard NFS mount whose server stopped; root only, tests/helpers/hung_mount.py),
  injected when the process entered state D. Loopback only: the bed's containers cannot mount NFS or
  FUSE (../shared/TESTBED.md);
- `partition`: the bundled trainer; node 1's firewall (iptables in ct-worker1, put ahead of ufw's
  chains) drops every TCP packet from its two peers but SSH's, so the collectives wait while the
  launcher still reaches the node. Bed only (tests/local/test_hang_partition_sim.py does it on
  simulated nodes); the rules are removed after.

`--engine deepspeed` runs the bundled trainer's kinds (sigstop, sleep, stuck-in-step, partition) with
DeepSpeed ZeRO-2 instead of DDP. On the bed, your command's script is copied to the shared dir (the
nodes see it there) and each run's dir is removed after.

Run (about a minute or two per kind on 2 loaded cores):
    .venv/bin/python bench/hangs.py [--bed] [--kinds sigstop,sleep,stuck-in-step,torchrun-sigstop,
                                             torchrun-sleep,torchrun-diverged,dstate,partition]
                                    [--engine ddp|deepspeed] [--stall-timeout 20]
                                    [--log FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO / "tests"))
from helpers.hung_mount import hung_mount  # noqa: E402 - the tests' helpers: one way to hang a mount
from helpers.loopback import write_inventory  # noqa: E402
from helpers.loopback_launch import TINY, environ, launch_command, trainer_pids  # noqa: E402
from helpers.testbed_nodes import INVENTORY as BED_INVENTORY  # noqa: E402
from helpers.testbed_nodes import STATUS as BED_STATUS  # noqa: E402
from helpers.testbed_nodes import cluster_settings, podman  # noqa: E402

KINDS = (
    "sigstop", "sleep", "stuck-in-step", "torchrun-sigstop", "torchrun-sleep", "torchrun-diverged", "dstate",
    "partition",
)  # fmt: skip
#: Where each kind can run: the bed's containers have no FUSE or NFS mount; loopback nodes share one
#: network stack (one firewall for both).
BED_ONLY, LOOPBACK_ONLY = {"partition"}, {"dstate"}
#: The bed's training account (molecule/default/inventory: cluster_training_uid and _gid).
BED_TRAINING_ID = 2000
#: A user's all-reduce loop whose rank HANG_RANK hangs at step HANG_STEP (HANG=sleep or stop).
HANG_LOOP = REPO / "tests" / "data" / "hang_user" / "allreduce_loop.py"
#: A user's loop whose rank HANG_RANK calls all_gather at step HANG_STEP where the others all_reduce.
DIVERGED_LOOP = HANG_LOOP.with_name("diverged_loop.py")
#: Your own command's kinds: how the rank hangs (HANG: SIGSTOP, a sleep outside the collective, or
#: all_gather, which diverged_loop.py does whatever HANG says), the script, the processes per node
#: (two where a majority must wait in the collective the diverged rank is not in).
TORCHRUN_KINDS = {
    "torchrun-sigstop": ("stop", HANG_LOOP, 1),
    "torchrun-sleep": ("sleep", HANG_LOOP, 1),
    "torchrun-diverged": ("all_gather", DIVERGED_LOOP, 2),
}


class Launch:
    """A launcher in the background, its output lines stamped (time.monotonic()) as they arrive."""

    def __init__(self, command: list[str]) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, prefix: str) -> tuple[float, str] | None:
        return next(((t, text) for t, text in self.lines if text.startswith(prefix)), None)

    def wait(self, timeout: float = 900) -> int:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._reader.join(timeout=30)
        return code


def wait_for(predicate: Callable[[], object], what: str, launch: Launch, timeout: float = 600) -> object:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if launch.proc.poll() is not None:
            launch.wait()
            said = "\n".join(text for _, text in launch.lines[-15:])
            raise SystemExit(
                f"the launcher ended ({launch.proc.returncode}) before {what}; its last lines:\n{said}"
            )
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} within {timeout:.0f} s")
        time.sleep(0.1)
    return value


def progress(node_dir: Path, rank: int) -> dict:
    try:
        return json.loads((node_dir / "progress" / f"rank-{rank}.json").read_text())
    except (OSError, ValueError):
        return {}


def state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def node_pids(node_dir: Path, program: str) -> list[int]:
    """This launch's processes on the node whose command line has `program` (by its tag and node rank)."""
    launch_id = (node_dir / "launch-id").read_text().strip() if (node_dir / "launch-id").exists() else ""
    tag = f"CLUSTERTRAIN_LAUNCH_ID={launch_id}".encode()
    node = f"NODE_RANK={node_dir.name.removeprefix('node-')}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        env = environ(int(proc.name))
        if launch_id and tag in env and node in env:
            try:
                if program in (proc / "cmdline").read_bytes().decode("utf-8", "replace"):
                    found.append(int(proc.name))
            except OSError:
                pass
    return found


@dataclass(frozen=True)
class Site:
    """Where the kinds run: an inventory per kind, the shared dir the controller sees the nodes' files
    in, and a dir for your command's script and the hang's mark that the nodes see too."""

    bed: bool

    def inventory(self, root: Path, processes: int, engine: str) -> tuple[Path, Path]:
        if not self.bed:
            settings = {"training_procs_per_node": processes, "training_engine": engine}
            inventory, shared = write_inventory(root, **settings)
            shared.mkdir(exist_ok=True)
            return inventory, shared
        inventory = root / "inventory"
        shutil.copytree(BED_INVENTORY, inventory)
        overrides = {"training_procs_per_node": processes, "training_engine": engine}
        (inventory / "group_vars" / "cluster" / "zz_hangs.yml").write_text(yaml.safe_dump(overrides))
        return inventory, Path(cluster_settings(inventory)["cluster_shared_dir"])

    def scripts_dir(self, root: Path, shared: Path) -> Path:
        """Loopback ranks run as this account and see `root`; the bed's see only the shared dir (a bind
        mount of this machine's), as the training account, which writes the hang's mark there."""
        if not self.bed:
            return root
        where = shared / f"bench-hangs-{uuid.uuid4().hex[:8]}"
        where.mkdir(mode=0o755)
        os.chown(where, BED_TRAINING_ID, BED_TRAINING_ID)
        return where


def run_kind(kind: str, root: Path, stall_s: float, site: Site, engine: str) -> dict:
    _, _, processes = TORCHRUN_KINDS.get(kind, ("", None, 1))
    inventory, shared = site.inventory(root, processes, engine)
    # The bed's shared dir outlives the bench: a run name of its own, and its dir removed after.
    run_name = f"hangs-{kind}-{uuid.uuid4().hex[:6]}" if site.bed else kind
    node1 = shared / "runs" / run_name / "launch" / "node-1"
    base = [*launch_command(inventory, "--run-name", run_name, "--stall-timeout", f"{stall_s:g}")]
    bundled = [*base, "--set", "train.max_steps=400", *TINY]
    try:
        return run_launch(kind, root, site, shared, node1, base, bundled)
    finally:
        if site.bed:
            shutil.rmtree(shared / "runs" / run_name, ignore_errors=True)


def run_launch(
    kind: str, root: Path, site: Site, shared: Path, node1: Path, base: list[str], bundled: list[str]
) -> dict:
    if kind == "sigstop":
        launch = Launch(bundled)
        wait_for(lambda: int(progress(node1, 1).get("started") or 0) >= 4, "rank 1 in step 4", launch)
        for pid in wait_for(lambda: trainer_pids(node1), "node1's trainer", launch):
            os.kill(pid, signal.SIGSTOP)
        injected = time.monotonic()
    elif kind == "sleep":
        launch = Launch([*bundled, "--env", "TRAINER_TEST_STALL=1:6:3600"])
        record = node1 / "progress" / "rank-1.json"
        wait_for(lambda: int(progress(node1, 1).get("done") or 0) >= 5, "rank 1's step 5 done", launch)
        # The rank sleeps right after writing that record: its age is how long ago the sleep began.
        injected = time.monotonic() - (time.time() - record.stat().st_mtime)
    elif kind == "stuck-in-step":
        launch = Launch([*bundled, "--env", "TRAINER_TEST_STALL_IN=1:6:3600"])
        record = node1 / "progress" / "rank-1.json"
        wait_for(lambda: int(progress(node1, 1).get("started") or 0) >= 6, "rank 1 in step 6", launch)
        # Written within a second of the sleep's start (the progress writer's interval): counted from then.
        injected = time.monotonic() - (time.time() - record.stat().st_mtime)
    elif kind in TORCHRUN_KINDS:
        return run_torchrun(kind, root, site, shared, base)
    elif kind == "partition":
        return run_partition(bundled, node1)
    else:
        return run_dstate(root, base, node1)
    return measured(kind, launch, injected)


def run_torchrun(kind: str, root: Path, site: Site, shared: Path, base: list[str]) -> dict:
    """Your own command: the rank hangs itself at step 20, as TORCHRUN_KINDS says."""
    where = site.scripts_dir(root, shared)
    mark = where / "hang-mark"
    hang, script, processes = TORCHRUN_KINDS[kind]
    if site.bed:
        script = Path(shutil.copy(script, where / script.name))
    command = ["--", "torchrun", "--nproc-per-node", str(processes), str(script)]
    settings = ["--env", f"HANG_MARK={mark}", "--env", "HANG_STEP=20", "--env", f"HANG={hang}"]
    try:
        launch = Launch([*base, *settings, *command])
        wait_for(mark.exists, f"rank 1's {hang}", launch)
        time.sleep(0.5)  # the mark is written whole before the rank hangs
        # The mark holds the time the rank's hang began.
        injected = time.monotonic() - (time.time() - float(mark.read_text()))
        return measured(kind, launch, injected)
    finally:
        if site.bed:
            shutil.rmtree(where, ignore_errors=True)


def run_partition(bundled: list[str], node1: Path) -> dict:
    """ct-worker1 (node 1) drops every TCP packet from its peers but SSH's, once the run trains."""
    cut, peers = "ct-worker1", ("10.89.42.10", "10.89.42.12")  # the bed's fixed addresses (molecule.yml)
    rules = [["-s", peer, "-p", "tcp", "!", "--dport", "22", "-j", "DROP"] for peer in peers]
    launch = Launch([*bundled, "--set", "distributed.timeout_s=600"])  # gloo's own error well after
    try:
        wait_for(lambda: int(progress(node1, 1).get("started") or 0) >= 4, "rank 1 in step 4", launch)
        for rule in rules:  # first in INPUT: ahead of ufw's chains, which allow the cluster's ports
            podman("exec", cut, "iptables", "-I", "INPUT", "1", *rule)
        injected = time.monotonic()
        return measured("partition", launch, injected)
    finally:
        for rule in rules:
            podman("exec", cut, "iptables", "-D", "INPUT", *rule, check=False)


def run_dstate(root: Path, base: list[str], node1: Path) -> dict:
    if os.geteuid() != 0 or not Path("/dev/fuse").exists():
        return {"kind": "dstate", "skipped": "needs root and /dev/fuse"}
    mount = root / "nfs"
    mount.mkdir()
    script = (
        'echo "node $NODE_RANK ready"; '
        f'if [ "$NODE_RANK" = 1 ]; then sleep 5; exec {sys.executable} -c '
        f"\"open('{mount}/shard.bin').read()\"; "
        "else exec sleep 3600; fi"
    )
    with hung_mount(str(mount)):
        launch = Launch([*base, "--", "bash", "-c", script])
        wait_for(
            lambda: [p for p in node_pids(node1, "shard.bin") if state_of(p) == "D"],
            "a process in state D",
            launch,
        )
        injected = time.monotonic()
        return measured("dstate", launch, injected)


def measured(kind: str, launch: Launch, injected: float) -> dict:
    code = launch.wait()
    detected = launch.first("stalled (")
    # The culprit is named at the `culprit:` line where the states are read before the stop (since
    # issue 39's second slice), else at the report after the stop (`hung:`, or `stalled:` without one).
    reported = launch.first("hung: ") or launch.first("stalled: ")
    named = launch.first("culprit: ") or reported
    return {
        "kind": kind,
        "exit_code": code,
        "detected_s": round(detected[0] - injected, 1) if detected else None,
        "named_s": round(named[0] - injected, 1) if named else None,
        "reported_s": round(reported[0] - injected, 1) if reported else None,
        "named": named[1] if named else "(nothing named)",
        # Where nothing hung was named: what the launcher said, to see why.
        "output": [f"{t - injected:7.1f} {text}" for t, text in launch.lines],
        "said": []
        if named and named[1].startswith(("hung: ", "culprit: "))
        else [text for _, text in launch.lines[-25:]],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", default="", help=f"comma-separated, of {', '.join(KINDS)} (default: all)")
    parser.add_argument("--stall-timeout", type=float, default=20.0, help="the launches' --stall-timeout")
    parser.add_argument("--log", type=Path, help="write every launcher's whole output here")
    parser.add_argument("--bed", action="store_true", help="on the Molecule test bed (it must be up)")
    parser.add_argument("--engine", choices=("ddp", "deepspeed"), default="ddp", help="the bundled trainer's")
    args = parser.parse_args()
    site, elsewhere = Site(bed=args.bed), LOOPBACK_ONLY if args.bed else BED_ONLY
    kinds = [k for k in (args.kinds or ",".join(k for k in KINDS if k not in elsewhere)).split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown kind(s) {', '.join(unknown)}; known: {', '.join(KINDS)}")
    if args.bed and not (BED_STATUS.exists() and BED_STATUS.read_text().startswith("up")):
        parser.error(f"the test bed is not up ({BED_STATUS}): scripts/testbed/molecule.sh converge first")
    where = "the test bed" if args.bed else "two loopback hosts"
    print(
        f"load: {os.getloadavg()[0]:.1f} (1 min), {where}, --stall-timeout {args.stall_timeout:g}, "
        f"engine {args.engine} (the bundled trainer's kinds)",
        flush=True,
    )
    results = []
    for kind in kinds:
        if kind in elsewhere:
            results.append({"kind": kind, "skipped": f"not on {where}"})
            print(f"{kind:17} skipped: not on {where}", flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix=f"hangs-{kind}-") as root:
            result = run_kind(kind, Path(root), args.stall_timeout, site, args.engine)
        results.append(result)
        if args.log:
            with args.log.open("a") as log:
                log.write(f"=== {kind}\n" + "\n".join(result.pop("output", [])) + "\n")
        result.pop("output", None)
        if "skipped" in result:
            print(f"{kind:17} skipped: {result['skipped']}", flush=True)
            continue
        print(
            f"{kind:17} detected {result['detected_s']} s, named {result['named_s']} s, reported (all "
            f"stopped) {result['reported_s']} s after the injection, exit {result['exit_code']}: "
            f"{result['named']}",
            flush=True,
        )
        for line in result.pop("said"):
            print(f"    {line}", flush=True)
    print(json.dumps(results))
    return 0 if all(r.get("named_s") is not None or "skipped" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
