"""The controller's cost per node: launch, following, status, stop and preflight on N simulated nodes.

For each N (default 2 4 8 16 32 64) this brings up N simulated nodes (scripts/testbed/netns_nodes.py:
a network namespace and a real sshd per node, Ansible logging in as root and becoming the training
user, host keys pinned) and times, one round each:

- `trainer launch -- true`: wall, controller CPU, controller peak memory, node CPU, and the SSH
  masters of the launch still alive when it returned;
- following: `trainer launch -- sleep` once every node's command runs, the controller's CPU over a
  window (--follow-s) as % of one core per node, the nodes' CPU over the same window, and the
  controller's memory over it (mean of the samples);
- `trainer status` and `trainer stop` on that running job (the launcher still following it);
- `trainer preflight --skip deepspeed` (its fast pass), with the failures its report counts;
- for N <= 4: the bundled trainer (the embedded tiny GPT, on the CPU) from the command to rank 0's
  first step on the screen.

Then the cost per added node of each column: the least-squares slope over the N measured.

What is counted: the controller is every process the command starts (ansible-playbook, its forks,
ssh and the SSH masters that detach from it), all in one cgroup v2 directory per command, so
controller CPU is that cgroup's usage (without cgroup v2: the child's wait4 rusage, which misses
the detached masters). Memory, sampled every 0.2 s, is the sum of their proportional set sizes
(PSS, /proc/PID/smaps_rollup): a page shared by k processes counts 1/k in each, so the copy-on-write
pages every Ansible worker shares with ansible-playbook count once. The sum of their resident sets
(RSS), which counts those pages again in every worker, is kept beside it in the JSON for comparison,
and so is the memory their cgroup is charged less its page cache (anonymous and kernel memory, each
page once; a cgroup v1 memory directory where cgroup v2 has no memory controller).
Node CPU is every process of every node (netns_nodes' cgroup). The controller and all the nodes
share this machine's cores: read the CPU columns as the work, not the wall as what a real cluster
would see. Status and stop are measured on the running job once its launcher is ended (as after a launcher
that died), so the following polls' CPU is not mixed into theirs.

Needs root (namespaces, sshd, a throwaway user); without it, says so and exits 0. Results as JSON
with --json FILE.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: Whose `trainer` the commands run (--checkout: another tree, e.g. `git archive COMMIT | tar -x`).
CHECKOUT = REPO
STEP = re.compile(r"^step (\d+)/(\d+)")
TRAIN_SETS = ["train.max_steps=6", "train.warmup_steps=1", "train.log_every=1", "checkpoint.save_steps=0"]
PARTS = ("launch", "follow", "status", "stop", "preflight", "first_step")
#: Any one command still running this long has hung, not slowed down.
COMMAND_TIMEOUT_S = 1800.0
#: The bundled trainer to its first step only this small (it trains on these 2 cores).
FIRST_STEP_MAX_NODES = 4
#: The running job's command; `trainer stop` ends it long before.
SLEEP_S = "3600"
SLEEP_COMMAND = f"sleep\0{SLEEP_S}\0".encode()
#: A failed check in preflight's JSON report (trainer.controller.preflight.report.FAIL).
FAIL = "fail"


def _load_netns_nodes() -> Any:
    path = REPO / "scripts" / "testbed" / "netns_nodes.py"
    spec = importlib.util.spec_from_file_location("netns_nodes", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


netns_nodes = _load_netns_nodes()


@dataclass
class Measured:
    """One command: seconds of wall, controller CPU and node CPU, peak controller memory (MiB)."""

    wall_s: float
    controller_cpu_s: float
    peak_pss_mib: float
    node_cpu_s: float
    rc: int
    masters_left: int = 0
    connections_left: int = 0
    #: The largest sum of resident sets: what this column showed before (copy-on-write pages counted
    #: in every worker), and the largest charge of the command's memory cgroup less its page cache.
    peak_rss_sum_mib: float = 0.0
    peak_charged_mib: float | None = None
    output: str = field(default="", repr=False)


@dataclass(frozen=True)
class MemorySample:
    """The controller's memory at one moment (MiB): see the module docstring."""

    at: float
    pss_mib: float
    rss_sum_mib: float
    charged_mib: float | None


#: cgroup v1's memory hierarchy, for the charge where cgroup v2 has no memory controller (hybrid systems).
CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")


class ControllerGroup:
    """A cgroup v2 directory for one command's processes (and whatever detaches from them)."""

    def __init__(self, name: str) -> None:
        root = netns_nodes._cgroup2_root()
        self.path: Path | None = None
        #: Where the group's memory is charged: this directory's memory.current, or a cgroup v1
        #: memory directory of the same name; None where neither can be made.
        self.memory: Path | None = None
        if root is not None:
            with contextlib.suppress(OSError):
                (root / name).mkdir(exist_ok=True)
                self.path = root / name
        if self.path is not None and (self.path / "memory.current").exists():
            self.memory = self.path
        elif CGROUP_V1_MEMORY.is_dir():
            with contextlib.suppress(OSError):
                (CGROUP_V1_MEMORY / name).mkdir(exist_ok=True)
                self.memory = CGROUP_V1_MEMORY / name

    def join(self) -> None:
        """preexec_fn: the child enters the group before it runs the command."""
        for directory in {self.path, self.memory} - {None}:
            with open(directory / "cgroup.procs", "w") as procs:
                procs.write(str(os.getpid()))

    def charged_mib(self) -> float | None:
        """The group's memory charge less its page cache (reclaimable), in MiB; None where unknown."""
        if self.memory is None:
            return None
        try:
            v2 = self.memory == self.path
            usage = int((self.memory / ("memory.current" if v2 else "memory.usage_in_bytes")).read_text())
            stat = dict(line.split() for line in (self.memory / "memory.stat").read_text().splitlines())
            return (usage - int(stat["file" if v2 else "cache"])) / 2**20
        except (OSError, ValueError, KeyError):
            return None

    def cpu_s(self) -> float | None:
        if self.path is None:
            return None
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, value = line.split()
            if key == "usage_usec":
                return int(value) / 1e6
        return None

    def pids(self) -> list[int]:
        if self.path is None:
            return []
        try:
            return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill(self) -> None:
        """End what is left (SSH masters the command left behind) so the next command starts clean."""
        if self.path is None:
            return
        deadline = time.monotonic() + 10
        while self.pids() and time.monotonic() < deadline:
            try:
                (self.path / "cgroup.kill").write_text("1")
            except OSError:
                for pid in self.pids():
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def remove(self) -> None:
        if self.path is not None:
            self.kill()
            with contextlib.suppress(OSError):
                self.path.rmdir()
        if self.memory is not None and self.memory != self.path:
            with contextlib.suppress(OSError):
                self.memory.rmdir()


def _pss_and_rss_mib(pids: list[int]) -> tuple[float, float]:
    """(sum of PSS, sum of RSS) of these processes in MiB, from /proc/PID/smaps_rollup."""
    pss_kib = rss_kib = 0
    for pid in pids:
        try:
            rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        for line in rollup.splitlines():
            key, _, rest = line.partition(":")
            if key == "Pss":
                pss_kib += int(rest.split()[0])
            elif key == "Rss":
                rss_kib += int(rest.split()[0])
    return pss_kib / 1024, rss_kib / 1024


def _tree(pid: int) -> list[int]:
    """pid and its live descendants (the fallback without a cgroup)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(Path(f"{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def is_master(pid: int) -> bool:
    """An SSH master: ssh gives it the title `ssh: SOCKET [mux]`."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return False
    return title.startswith("ssh: ") and title.endswith("[mux]")


class Command:
    """One controller command, started now, measured until it ends (`finish`)."""

    def __init__(self, argv: list[str], cluster: Any, group: str) -> None:
        self.cluster = cluster
        self.group = ControllerGroup(group)
        self.node_cpu_before = cluster.node_cpu_s()
        self.cpu_before = self.group.cpu_s()
        self.memory: list[MemorySample] = []
        self.lines: list[str] = []
        self.started = time.monotonic()
        env = dict(os.environ, PYTHONUNBUFFERED="1", TERM="dumb", COLUMNS="200")
        if CHECKOUT != REPO:
            env["PYTHONPATH"] = str(CHECKOUT)
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=CHECKOUT,
            preexec_fn=self.group.join,
        )
        self.on_line: Callable[[str], None] | None = None
        self._done: tuple[int, int, Any] | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._sampling = True
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if self.on_line is not None:
                self.on_line(line)

    def _sample(self) -> None:
        while self._sampling:
            pids = self.group.pids() if self.group.path is not None else _tree(self.proc.pid)
            pss, rss = _pss_and_rss_mib(pids)
            self.memory.append(MemorySample(time.monotonic(), pss, rss, self.group.charged_mib()))
            time.sleep(0.2)

    def peak(self, key: str) -> float | None:
        """The largest sample of `key` (a MemorySample field) so far; None where never known."""
        values = [getattr(s, key) for s in list(self.memory) if getattr(s, key) is not None]
        return max(values, default=None)

    def mean_between(self, start: float, end: float) -> dict[str, float | None]:
        """Each memory figure's mean over the samples taken between two time.monotonic() values."""
        window = [s for s in list(self.memory) if start <= s.at <= end]
        means: dict[str, float | None] = {}
        for key in ("pss_mib", "rss_sum_mib", "charged_mib"):
            values = [getattr(s, key) for s in window if getattr(s, key) is not None]
            means[key] = sum(values) / len(values) if values else None
        return means

    def cpu_s(self) -> float:
        now = self.group.cpu_s()
        return 0.0 if now is None else now - (self.cpu_before or 0.0)

    def finish(self, timeout: float = COMMAND_TIMEOUT_S) -> Measured:
        try:
            _, status, usage = self._wait4(timeout)
        finally:
            self._sampling = False
        wall = time.monotonic() - self.started
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        self._reader.join(10)
        cpu = self.cpu_s() if self.group.path is not None else usage.ru_utime + usage.ru_stime
        node_cpu = self.cluster.node_cpu_s() - self.node_cpu_before
        masters = sum(1 for pid in self.group.pids() if is_master(pid))
        connections = len(self.cluster.ssh_connections())
        self.group.remove()
        output = "".join(self.lines)
        return Measured(
            wall,
            cpu,
            self.peak("pss_mib") or 0.0,
            node_cpu,
            self.proc.returncode,
            masters,
            connections,
            self.peak("rss_sum_mib") or 0.0,
            self.peak("charged_mib"),
            output,
        )

    def exited(self) -> bool:
        """Whether the command has ended (reaped here with its rusage: Popen.poll would lose that)."""
        if self._done is None:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                self._done = (pid, status, usage)
        return self._done is not None

    def _wait4(self, timeout: float) -> tuple[int, int, Any]:
        deadline = time.monotonic() + timeout
        while not self.exited():
            if time.monotonic() > deadline:
                self.proc.send_signal(signal.SIGINT)
                self._done = os.wait4(self.proc.pid, 0)
                break
            time.sleep(0.05)
        return self._done


def trainer(*args: str) -> list[str]:
    return [sys.executable, "-m", "trainer", *args]


def must_succeed(what: str, measured: Measured) -> Measured:
    if measured.rc != 0:
        tail = "".join(measured.output.splitlines(keepends=True)[-25:])
        raise SystemExit(f"{what} failed (exit {measured.rc}):\n{tail}")
    return measured


def measure_launch_true(cluster: Any, tag: str) -> Measured:
    command = Command(
        trainer("launch", "-i", str(cluster.inventory), "--run-name", f"{tag}-true", "--", "true"),
        cluster,
        f"ctsim-bench-{os.getpid()}-launch",
    )
    return must_succeed("trainer launch -- true", command.finish())


def _started_nodes(cluster: Any, run: str) -> int:
    """Nodes whose run.sh started: each writes its pid file first thing."""
    return len(list((cluster.shared / "runs" / run / "launch").glob("node-*/pid")))


def measure_running_job(cluster: Any, tag: str, args: argparse.Namespace, result: dict) -> None:
    """`launch -- sleep` followed for a window, then status and stop on it while it is followed."""
    run = f"{tag}-sleep"
    launch = Command(
        trainer("launch", "-i", str(cluster.inventory), "--run-name", run, "--", "sleep", SLEEP_S),
        cluster,
        f"ctsim-bench-{os.getpid()}-follow",
    )
    deadline = time.monotonic() + COMMAND_TIMEOUT_S
    while _started_nodes(cluster, run) < cluster.n:
        if launch.exited() or time.monotonic() > deadline:
            tail = "".join(launch.lines[-25:])
            raise SystemExit(f"trainer launch -- sleep ended or hung before every node started:\n{tail}")
        time.sleep(0.2)
    result["sleep_all_started_s"] = time.monotonic() - launch.started
    # A few seconds for the launcher to see every node running and settle into its polls.
    time.sleep(args.settle_s)
    cpu0, node0, t0 = launch.cpu_s(), cluster.node_cpu_s(), time.monotonic()
    time.sleep(args.follow_s)
    cpu1, node1, t1 = launch.cpu_s(), cluster.node_cpu_s(), time.monotonic()
    window = t1 - t0
    follow_node_rate = (node1 - node0) / window
    if "follow" not in args.skip:
        memory = launch.mean_between(t0, t1)
        result["follow"] = {
            "window_s": window,
            "controller_core_pct": 100 * (cpu1 - cpu0) / window,
            "controller_core_pct_per_node": 100 * (cpu1 - cpu0) / window / cluster.n,
            "node_core_pct": 100 * follow_node_rate,
            # Over the window, as it follows: what one followed node holds, start-up's peak aside.
            "pss_mib": memory["pss_mib"],
            "rss_sum_mib": memory["rss_sum_mib"],
            "charged_mib": memory["charged_mib"],
            "peak_pss_mib": launch.peak("pss_mib"),
            "peak_rss_sum_mib": launch.peak("rss_sum_mib"),
        }
    # The launcher is ended here (it, its ansible-playbook and its SSH masters: its cgroup) and the job
    # keeps running on the nodes, as after a launcher that died: status and stop are then measured
    # alone, without the following polls' CPU on the nodes mixed into theirs.
    launch.group.kill()
    launch.finish(timeout=60)
    inventory = str(cluster.inventory)
    if "status" not in args.skip:
        status = Command(
            trainer("status", "-i", inventory, "--run-name", run),
            cluster,
            f"ctsim-bench-{os.getpid()}-status",
        )
        result["status"] = _row(must_succeed("trainer status", status.finish()))
    stop = Command(
        trainer("stop", "-i", inventory, "--run-name", run), cluster, f"ctsim-bench-{os.getpid()}-stop"
    )
    stopped = must_succeed("trainer stop", stop.finish())
    if "stop" not in args.skip:
        result["stop"] = _row(stopped)
    deadline = time.monotonic() + 15
    while (left := _sleeping(cluster)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        raise SystemExit(f"trainer stop left {len(left)} node command(s) running:\n{stopped.output[-2000:]}")


def _sleeping(cluster: Any) -> list[int]:
    """The pids of the job's `sleep` commands still running on the nodes (as the training user)."""
    uid = pwd.getpwnam(cluster.user).pw_uid
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if entry.stat().st_uid == uid and (entry / "cmdline").read_bytes() == SLEEP_COMMAND:
                found.append(int(entry.name))
    return found


def _row(measured: Measured) -> dict:
    row = asdict(measured)
    row.pop("output")
    return row


def measure_preflight(cluster: Any, workdir: Path) -> dict:
    report = workdir / "preflight.json"
    command = Command(
        trainer("preflight", "-i", str(cluster.inventory), "--skip", "deepspeed", "--report", str(report)),
        cluster,
        f"ctsim-bench-{os.getpid()}-preflight",
    )
    measured = command.finish()
    row = asdict(measured)
    row.pop("output")
    try:
        results = json.loads(report.read_text()).get("results", [])
    except (OSError, ValueError):
        results = []
        row["report_missing"] = measured.output.splitlines()[-5:]
    failed = [r for r in results if r.get("status") == FAIL]
    row["failures"] = len(failed)
    row["ssh_failures"] = sum(1 for r in failed if r.get("check") == "ssh")
    row["failed_checks"] = sorted({r.get("check") for r in failed})
    return row


def measure_first_step(cluster: Any, tag: str) -> dict:
    sets = [arg for item in TRAIN_SETS for arg in ("--set", item)]
    command = Command(
        trainer("launch", "-i", str(cluster.inventory), "--run-name", f"{tag}-train", *sets),
        cluster,
        f"ctsim-bench-{os.getpid()}-train",
    )
    first: list[float] = []

    def see(line: str) -> None:
        if not first and STEP.match(line):
            first.append(time.monotonic() - command.started)

    command.on_line = see
    measured = must_succeed("trainer launch (bundled trainer)", command.finish())
    if not first:
        raise SystemExit(f"the bundled trainer logged no step:\n{measured.output[-2000:]}")
    row = asdict(measured)
    row.pop("output")
    row["first_step_s"] = first[0]
    return row


def measure(n: int, args: argparse.Namespace) -> dict:
    result: dict[str, Any] = {"n": n}
    with tempfile.TemporaryDirectory(prefix=f"bench-scale-{n}-") as tmp:
        workdir = Path(tmp)
        workdir.chmod(0o755)  # the nodes' training user works under it
        started = time.monotonic()
        with netns_nodes.nodes(n, workdir / "sim") as cluster:
            result["up_s"] = time.monotonic() - started
            tag = f"scale{n}"
            if "launch" not in args.skip:
                row = asdict(measure_launch_true(cluster, tag))
                row.pop("output")
                result["launch"] = row
            if not {"follow", "status", "stop"} <= set(args.skip):
                measure_running_job(cluster, tag, args, result)
            if "preflight" not in args.skip and n <= args.preflight_max_nodes:
                result["preflight"] = measure_preflight(cluster, workdir)
            if "first_step" not in args.skip and n <= FIRST_STEP_MAX_NODES:
                result["first_step"] = measure_first_step(cluster, tag)
    return result


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of y on x: the cost per added node."""
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else None


#: What each table shows: (part, column title, key, format).
TABLES = {
    "launch": (
        "trainer launch -- true",
        [
            ("wall s", "wall_s", "{:.1f}"),
            ("ctl CPU s", "controller_cpu_s", "{:.2f}"),
            ("ctl peak PSS MiB", "peak_pss_mib", "{:.0f}"),
            ("node CPU s", "node_cpu_s", "{:.1f}"),
            ("masters left", "masters_left", "{:.0f}"),
            ("ssh conns left", "connections_left", "{:.0f}"),
        ],
    ),
    "follow": (
        "following a running job (launch -- sleep)",
        [
            ("ctl % core", "controller_core_pct", "{:.1f}"),
            ("ctl % core/node", "controller_core_pct_per_node", "{:.2f}"),
            ("node % core", "node_core_pct", "{:.1f}"),
            ("ctl PSS MiB", "pss_mib", "{:.0f}"),
            ("ctl RSS sum MiB", "rss_sum_mib", "{:.0f}"),
            ("ctl charged MiB", "charged_mib", "{:.0f}"),
            ("ctl peak PSS MiB", "peak_pss_mib", "{:.0f}"),
        ],
    ),
    "status": (
        "trainer status (on the running job)",
        [
            ("wall s", "wall_s", "{:.1f}"),
            ("ctl CPU s", "controller_cpu_s", "{:.2f}"),
            ("ctl peak PSS MiB", "peak_pss_mib", "{:.0f}"),
            ("node CPU s", "node_cpu_s", "{:.1f}"),
        ],
    ),
    "stop": (
        "trainer stop (on the running job)",
        [
            ("wall s", "wall_s", "{:.1f}"),
            ("ctl CPU s", "controller_cpu_s", "{:.2f}"),
            ("ctl peak PSS MiB", "peak_pss_mib", "{:.0f}"),
            ("node CPU s", "node_cpu_s", "{:.1f}"),
        ],
    ),
    "preflight": (
        "trainer preflight --skip deepspeed",
        [
            ("wall s", "wall_s", "{:.1f}"),
            ("ctl CPU s", "controller_cpu_s", "{:.2f}"),
            ("ctl peak PSS MiB", "peak_pss_mib", "{:.0f}"),
            ("node CPU s", "node_cpu_s", "{:.1f}"),
            ("failures", "failures", "{:.0f}"),
            ("ssh failures", "ssh_failures", "{:.0f}"),
        ],
    ),
    "first_step": (
        "bundled trainer to its first step (N <= 4)",
        [
            ("first step s", "first_step_s", "{:.1f}"),
            ("wall s (6 steps)", "wall_s", "{:.1f}"),
            ("ctl CPU s", "controller_cpu_s", "{:.2f}"),
            ("node CPU s", "node_cpu_s", "{:.1f}"),
        ],
    ),
}


def slopes(results: list[dict]) -> dict[str, dict[str, float]]:
    fitted: dict[str, dict[str, float]] = {}
    for part, (_, columns) in TABLES.items():
        for _, key, _ in columns:
            points = [(r["n"], r[part][key]) for r in results if r.get(part, {}).get(key) is not None]
            value = slope(points)
            if value is not None:
                fitted.setdefault(part, {})[key] = value
    return fitted


def table(results: list[dict], fitted: dict) -> str:
    """Markdown tables, one per command, with the fitted cost per added node under each."""
    out = []
    for part, (title, columns) in TABLES.items():
        rows = [r for r in results if part in r]
        if not rows:
            continue
        out += [f"\n{title}\n", "| N | " + " | ".join(c[0] for c in columns) + " |"]
        out.append("|---" * (len(columns) + 1) + "|")
        for r in rows:
            cells = [
                fmt.format(r[part][key]) if r[part].get(key) is not None else "" for _, key, fmt in columns
            ]
            out.append(f"| {r['n']} | " + " | ".join(cells) + " |")
        per_node = fitted.get(part, {})
        if per_node:
            cells = [f"{per_node[key]:+.3f}" if key in per_node else "" for _, key, _ in columns]
            out.append("| per added node | " + " | ".join(cells) + " |")
    return "\n".join(out)


def commit() -> str:
    """What is measured: HEAD, and whether trainer/ differs from it; or the --checkout's path."""
    if CHECKOUT != REPO:
        return f"checkout {CHECKOUT}"
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "trainer"], cwd=REPO, capture_output=True, text=True
    )
    return done.stdout.strip() + ("+changes in trainer/" if dirty.stdout.strip() else "")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nodes", default="2,4,8,16,32,64", help="node counts, comma-separated (default: 2,4,8,16,32,64)"
    )
    parser.add_argument("--skip", default="", help=f"parts to leave out, comma-separated: {', '.join(PARTS)}")
    parser.add_argument(
        "--preflight-max-nodes",
        type=int,
        default=10**6,
        help="run preflight only up to this N (default: every N)",
    )
    parser.add_argument(
        "--follow-s", type=float, default=10.0, help="seconds of following measured (default: 10)"
    )
    parser.add_argument(
        "--settle-s",
        type=float,
        default=3.0,
        help="seconds after every node started before that window (default: 3)",
    )
    parser.add_argument("--json", type=Path, help="write the raw numbers to this file")
    parser.add_argument(
        "--checkout",
        type=Path,
        help="run the trainer commands of another tree (e.g. main before a change: "
        "git archive COMMIT | tar -x -C DIR); the simulated nodes stay this one's",
    )
    args = parser.parse_args(argv)
    try:
        args.nodes = sorted({int(n) for n in args.nodes.split(",") if n.strip()})
    except ValueError:
        parser.error(f"--nodes {args.nodes!r}: give node counts as integers, e.g. --nodes 2,8")
    if not args.nodes or min(args.nodes) < 2:
        parser.error("--nodes: give counts of 2 or more (a cost per added node needs two nodes at least)")
    args.skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    unknown = args.skip - set(PARTS)
    if unknown:
        parser.error(f"--skip {', '.join(sorted(unknown))}: not a part; the parts are {', '.join(PARTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    global CHECKOUT
    if args.checkout is not None:
        if not (args.checkout / "trainer" / "__main__.py").is_file():
            raise SystemExit(
                f"--checkout {args.checkout}: no trainer/__main__.py there; give a tree of this project"
            )
        CHECKOUT = args.checkout.resolve()
    problem = netns_nodes.missing_requirements()
    if problem:
        print(f"bench/scale.py: skipped: {problem}")
        return 0
    if (
        shutil.which("ansible-playbook", path=f"{REPO / '.venv' / 'bin'}:{os.environ.get('PATH', '')}")
        is None
    ):
        print("bench/scale.py: skipped: no ansible-playbook (make install-dev)")
        return 0
    measured_at = commit()
    load_at_start = os.getloadavg()
    counts = ", ".join(map(str, args.nodes))
    print(f"scale: N = {counts} simulated nodes, commit {measured_at}, {os.cpu_count()} cores")
    results = []
    for n in args.nodes:
        print(f"== {n} nodes", flush=True)
        started = time.monotonic()
        results.append(measure(n, args))
        print(f"   ({time.monotonic() - started:.0f} s)", flush=True)
    fitted = slopes(results)
    print(table(results, fitted))
    print(f"\nload average (1, 5, 15 min): at the start {load_at_start}, at the end {os.getloadavg()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "commit": measured_at,
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "cores": os.cpu_count(),
                    "load_average_at_start_and_end": [load_at_start, os.getloadavg()],
                    "command": " ".join(["bench/scale.py", *(sys.argv[1:] if argv is None else argv)]),
                    "results": results,
                    "per_added_node": fitted,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
