"""The launcher's helper on each node: probe, start, report on and stop the trainer of one launch.

`trainer launch` runs it through its action plugin (playbooks/action_plugins/launch_node.py) as one
process per step and node: the venv's python with a short bootstrap, and one JSON request on stdin
that carries this program's own text, so a node always runs the controller's version and nothing is
copied first (one round trip per step, and no secret on a command line):

    {"op": "lock" | "probe" | "check" | "start" | "status" | "states" | "stop" | "pids", ...} -> one line

- lock (the head only): take, release or read the run's lock, `launch/lock` (one launcher per run
  name: a second launch is refused before its probe; see `lock`);
- probe: user, venv, the interface holding the cluster address, the master port, a previous run of
  the same name still running, InfiniBand/RoCE devices; and the command check (below) when this
  account is the training user already;
- check: the working directory can be entered and the program found, as the training user;
- start: keep the previous launch's log and exit record (log.N, exit.N), write the run's files (the
  head gets them), the node's secret variables, run.sh and this helper, then start run.sh detached
  (its own session and process group); with `reuse` (a restart by `trainer attach`), the run.sh,
  secret variables and run files already there are started as they are;
- status: state, exit record, the log's lines after the caller's offset (a long poll: it answers as
  soon as there is something new, or after `wait` seconds; with `quiet`, only the trainer's end
  cuts it short), each rank's progress;
- states: each rank's process state (the kernel's, see process_states), read at a stall before the
  stop, so that the culprit is named (and the stop's history record carries it) before the stacks and
  the TERM; signals nothing; with `peers` and `port`, whether each peer answers a connect on the port
  (reach_peers: a peer whose firewall drops the collective ports never answers); with `stacks` (a
  user's command), each rank's Python stack by py-spy (add_stacks);
- stop: each rank's process state (`states`: the kernel's, see process_states) and the stacks of the
  trainer's ranks when asked (a stall), then TERM to run.sh's process group (a stopped process of the
  launch continued to take it) and KILL to whatever is left after the grace period.

By hand (the copy `start` leaves in the node dir): `python node_ctl.py NODE_DIR status|stop|pids`.
A worker's run.sh also starts `node_ctl.py NODE_DIR watch-join` beside a user's command (the world
check; see `watch_join`).

torchrun puts every worker in a session of its own, so a signal to run.sh's process group does not
reach them: every process of the launch carries CLUSTERTRAIN_LAUNCH_ID (from `launch-id`) in its
environment, and that is how they are all found, even after their parent is gone.

The node dir holds `pid` (the process group leader run.sh writes), `log` (the command's output),
`exit` (JSON written by run.sh when the command ends), `torchrun/` (torchrun's --log-dir for the
bundled trainer: each rank's `error.json` per launch, read into a final report as `errors`),
`launch.json` (what the launcher started and with which watch settings, for `trainer status` and
`trainer attach`), `progress/rank-N.json` (the bundled trainer's ranks: the step each is in,
written by trainer.node.progress) and `secret-env` (the secret variables, mode 0600). A relaunch
renames the last launch's `log` and `exit` to `log.N` and `exit.N` (N = 1, 2, ... in launch order):
the evidence of a failure survives every later launch. On the head, `launch/history.jsonl` gets one
record per launch, restart and stop, and `launch/lock` names the launcher that holds the run (see
`lock`).
Standard library only: it runs with the node's venv python.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# pwd, re, shlex, shutil, socket and subprocess are imported where they are used: a status poll runs
# this every few seconds per node, and needs none of them.

#: Log bytes returned per poll at most; the rest comes with the next polls.
MAX_CHUNK = 128 * 1024
TAG_VARIABLE = "CLUSTERTRAIN_LAUNCH_ID"
#: How long a status poll lingers after the first new bytes, so a burst of lines comes in one answer.
LINGER_S = 0.05
#: How often a waiting status poll looks at the log and the exit record.
WAIT_STEP_S = 0.05
#: How often run.sh's join watcher (watch_join) scans this launch's connections on a worker.
JOIN_WATCH_S = 0.25
#: A poll that waited at least this long on a quiet node says how much CPU time and I/O the launch's
#: ranks used meanwhile (`activity`): the sign that a user's command that prints nothing still works.
ACTIVITY_MIN_S = 0.5
#: ... and only once its log has not grown for this long: a command that prints is seen working by its
#: lines, and reading every process's environment each poll would cost a node with many for nothing.
ACTIVITY_QUIET_S = 5.0

# The run's layout, as trainer/run_paths.py (RunPaths) defines it: this file imports nothing of the
# package (it is sent to the nodes as text), so it keeps these few names, and
# tests/unit/controller/test_run_paths.py ties them to RunPaths.
#: The head's node dir (node 0 hosts the job's store; it has no world check).
HEAD_NODE_DIR = "node-0"
HISTORY_FILE = "history.jsonl"
LOCK_FILE = "lock"


def runs_dir_of(node_dir: Path) -> Path:
    """`<shared>/runs` from `<shared>/runs/<run>/launch/node-N`."""
    return node_dir.parent.parent.parent


def lock_file_of(node_dir: Path) -> Path:
    return node_dir.parent / LOCK_FILE


def latest_checkpoint_file(output_dir: Path) -> Path:
    """The file naming the run's newest complete checkpoint."""
    return output_dir / "checkpoints" / "latest"


def _launch_id(node_dir: Path) -> str | None:
    try:
        return (node_dir / "launch-id").read_text().strip() or None
    except OSError:
        return None


def _environ(pid: int | str) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def tagged_pids(node_dir: Path) -> list[int]:
    """Live processes (not zombies) started by this launch on this node."""
    launch_id = _launch_id(node_dir)
    if launch_id is None:
        return []
    marker = f"{TAG_VARIABLE}={launch_id}".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marker not in (proc / "environ").read_bytes().split(b"\0"):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
        except (OSError, IndexError):
            continue
        found.append(int(proc.name))
    return sorted(found)


def rank_usage(node_dir: Path) -> dict[str, list]:
    """This launch's processes on this node by rank (torchrun's RANK; '' for those without one): their
    CPU seconds (/proc/<pid>/stat, every thread) and bytes read and written (/proc/<pid>/io's rchar and
    wchar, sockets included; None where this account may not read it)."""
    tick = os.sysconf("SC_CLK_TCK")
    usage: dict[str, list] = {}
    for proc, environ in node_processes(node_dir):
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
        try:
            io = dict(line.split(": ", 1) for line in (proc / "io").read_text().splitlines())
            moved: int | None = int(io["rchar"]) + int(io["wchar"])
        except (OSError, KeyError, ValueError):
            moved = None
        rank = next((v[5:].decode() for v in environ if v.startswith(b"RANK=")), "")
        total = usage.setdefault(rank, [0.0, 0])
        total[0] += cpu
        total[1] = None if moved is None or total[1] is None else total[1] + moved
    return usage


def activity(before: dict[str, list], after: dict[str, list], seconds: float) -> dict:
    """What each rank used between two rank_usage reads, `seconds` apart: {"seconds": s, "ranks":
    {rank: [CPU seconds, bytes or None]}}. A process that ended or began between them counts only as
    far as both reads saw it (a rank's total that went down is left out)."""
    ranks = {}
    for rank, (cpu, moved) in after.items():
        if rank not in before:
            continue
        cpu_s = cpu - before[rank][0]
        io = None if moved is None or before[rank][1] is None else moved - before[rank][1]
        if cpu_s >= 0 and (io is None or io >= 0):
            ranks[rank] = [round(cpu_s, 3), io]
    return {"seconds": round(seconds, 3), "ranks": ranks}


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _pid(node_dir: Path) -> int | None:
    try:
        return int((node_dir / "pid").read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) is not running.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _log_size(node_dir: Path) -> int:
    try:
        return (node_dir / "log").stat().st_size
    except OSError:
        return 0


def read_log(node_dir: Path, offset: int | None, tail: int = 0) -> tuple[list[str], int]:
    """(lines, next offset): whole lines after `offset`; with offset None, the last `tail` lines.

    A log shorter than the offset is a new launch's log (the last one was kept as log.N): read it
    from the start."""
    path = node_dir / "log"
    try:
        size = path.stat().st_size
        with open(path, "rb") as log:
            if offset is None:
                start = max(0, size - 64 * 1024)
                log.seek(start)
                chunk = log.read(size - start)
                end = chunk.rfind(b"\n") + 1
                lines = chunk[:end].decode("utf-8", "replace").splitlines()
                if start > 0 and lines:
                    lines = lines[1:]  # the first one is cut
                return (lines[-tail:] if tail else []), start + end
            if offset > size:
                offset = 0
            log.seek(offset)
            chunk = log.read(MAX_CHUNK)
    except OSError:
        return [], offset or 0
    # Only whole lines; a partial last line waits for the next poll (unless the chunk is full).
    end = chunk.rfind(b"\n") + 1 if len(chunk) < MAX_CHUNK else len(chunk)
    return chunk[:end].decode("utf-8", "replace").splitlines(), offset + end


def _skip_to_last_chunk(node_dir: Path, offset: int) -> int:
    """`offset`, or where the last MAX_CHUNK bytes of the log begin after a line's end when more is
    unread (the lines in between are left in the node's log)."""
    size = _log_size(node_dir)
    if size - offset <= MAX_CHUNK:
        return offset
    start = size - MAX_CHUNK
    try:
        with open(node_dir / "log", "rb") as log:
            log.seek(start)
            cut = log.read(MAX_CHUNK).find(b"\n")
    except OSError:
        return offset
    return start + cut + 1 if cut >= 0 else offset


def progress(node_dir: Path) -> list[dict]:
    """Each rank's progress record (trainer.node.progress), by rank."""
    found = []
    for path in sorted((node_dir / "progress").glob("rank-*.json")):
        record = _read_json(path)
        if isinstance(record, dict) and "rank" in record:
            found.append(record)
    return sorted(found, key=lambda r: int(r.get("rank", 0)))


def rank_exits(node_dir: Path) -> list[dict]:
    """Each rank's own exit record (trainer.node.exit_record: its code, one-line reason, whether that
    is a consequence of a peer's failure, the time), by rank: torchrun's own exit code is 1 whatever
    its workers' were."""
    found = []
    for path in sorted((node_dir / "progress").glob("exit-*.json")):
        record = _read_json(path)
        if isinstance(record, dict) and isinstance(record.get("rank"), int):
            record["message"] = str(record.get("message") or "")[:500]
            found.append(record)
    return sorted(found, key=lambda r: int(r["rank"]))


def _state(node_dir: Path, alive: bool | None = None) -> tuple[str, int | None, dict | None]:
    pid = _pid(node_dir)
    exit_record = _read_json(node_dir / "exit")
    if exit_record is not None:
        state = "exited"
    elif pid is None:
        state = "starting" if (node_dir / "launch-id").exists() else "none"
    elif alive if alive is not None else (_alive(pid) or tagged_pids(node_dir)):
        state = "running"
    else:
        # Gone without run.sh writing its exit record: the whole process group was killed.
        state = "vanished"
    return state, pid, exit_record


def rank_errors(node_dir: Path) -> list[dict]:
    """The error files of this launch's ranks on this node: torchrun's --log-dir is `torchrun/` here,
    with a subdir per launch (`<launch id>_<random>/attempt_N/<local rank>/error.json`), written by
    the trainer's `@record` when an exception ends a rank (torch's format: the exception as
    `Type: message`, its traceback, the time in whole seconds)."""
    launch_id = _launch_id(node_dir)
    if launch_id is None:
        return []
    found = []
    for path in sorted((node_dir / "torchrun").glob(f"{launch_id}_*/attempt_*/*/error.json")):
        data = _read_json(path)
        message = data.get("message") if isinstance(data, dict) else None
        if isinstance(message, str):  # torch's other form: the message alone
            message = {"message": message, "extraInfo": {}}
        if not isinstance(message, dict) or not path.parent.name.isdigit():
            continue
        extra = message.get("extraInfo") if isinstance(message.get("extraInfo"), dict) else {}
        try:
            timestamp = float(extra.get("timestamp") or 0) or path.stat().st_mtime
        except (OSError, ValueError):
            timestamp = 0.0
        found.append(
            {
                "local_rank": int(path.parent.name),
                "message": str(message.get("message") or "")[:2000],
                "traceback": str(extra.get("py_callstack") or "")[-8000:],
                "timestamp": timestamp,
                "file": str(path),
            }
        )
    return found


def status(
    node_dir: Path,
    offset: int | None = None,
    tail: int = 0,
    wait: float = 0.0,
    quiet: bool = False,
    alive: bool | None = None,
    usage: bool = False,
) -> dict:
    """The node's report. With an offset and `wait`, a long poll: it returns as soon as the log grew
    or the trainer ended, at the latest after `wait` seconds. `quiet`: a node whose lines nobody
    watches live (a worker; the launcher shows rank 0's): only its trainer's end cuts the wait short,
    and of a backlog longer than a chunk only the last chunk is read (its last lines are what a
    failure report shows), so following it costs one round trip per `wait`. `alive`: whether run.sh
    still runs, when the caller knows better than this host's process table (a Slurm step read from
    the shared dir on another host: the pid is the node's, so Slurm says whether the step runs).
    `usage`: a long poll that waited ACTIVITY_MIN_S or more says what the ranks used meanwhile
    (`activity`; a user's command, whose quiet the launcher must tell from a hang)."""
    waited_from = time.monotonic()
    deadline = waited_from + wait
    if quiet and offset is not None:
        offset = _skip_to_last_chunk(node_dir, offset)
    age = _log_age(node_dir)
    quiet_log = age is None or age >= ACTIVITY_QUIET_S
    sampled = usage and quiet_log and offset is not None and wait >= ACTIVITY_MIN_S
    before = rank_usage(node_dir) if sampled else None
    if offset is not None and wait > 0:
        pid = _pid(node_dir)
        while time.monotonic() < deadline:
            if (not quiet and _log_size(node_dir) != offset) or (node_dir / "exit").exists():
                time.sleep(LINGER_S)
                break
            if pid is not None and not _alive(pid):
                break
            time.sleep(WAIT_STEP_S)
    waited = time.monotonic() - waited_from
    used = (
        activity(before, rank_usage(node_dir), waited)
        if before is not None and waited >= ACTIVITY_MIN_S
        else None
    )
    state, pid, exit_record = _state(node_dir, alive)
    lines, next_offset = read_log(node_dir, offset, tail)
    info = _read_json(node_dir / "launch.json")
    return {
        "state": state,
        "pid": pid,
        "exit": exit_record,
        "stop_requested": (node_dir / "stop-requested").exists(),
        "lines": lines,
        "offset": next_offset,
        "launch_id": _launch_id(node_dir),
        "info": info,
        # Once ended, what run.sh's watcher saw (a short job may join and end between two polls).
        "joined": joined(node_dir, info) if state == "running" else seen_joined(node_dir) or None,
        "progress": progress(node_dir),
        "log_age_s": _log_age(node_dir),
        "activity": used,
        "time": time.time(),
        # Read once the trainer has ended (a poll of a running one needs none of it).
        "errors": rank_errors(node_dir) if state in ("exited", "vanished") else [],
        "rank_exits": rank_exits(node_dir) if state in ("exited", "vanished") else [],
        # The run's lock (on the head): for `trainer status`, not for every poll of a watch.
        "lock": _read_json(lock_file_of(node_dir)) if offset is None else None,
        # A run name with no launch here: the runs that have one, for the error to name.
        "runs": launched_runs(node_dir) if offset is None and state == "none" else None,
    }


def launched_runs(node_dir: Path, limit: int = 50) -> list[str]:
    """The runs beside this one (`<shared>/runs/<run>/launch/node-N`) that have a launch."""
    runs_dir = runs_dir_of(node_dir)
    try:
        names = sorted(path.parent.name for path in runs_dir.glob("*/launch") if path.is_dir())
    except OSError:
        return []
    return names[:limit]


def joined(node_dir: Path, info: dict | None) -> bool | None:
    """The world check of a user's command on a worker: whether a process of this launch holds a TCP
    connection to the head (the job's store on MASTER_ADDR, the collectives' peers). A worker whose
    command formed a job of its own never connects there. None where it is not asked (the bundled
    trainer knows its world; the head hosts it). Once seen, kept in `joined` (the next polls of a
    long run skip the scan of /proc)."""
    head = (info or {}).get("world_check", {}).get("head_address")
    if not head or node_dir.name == HEAD_NODE_DIR:
        return None
    if seen_joined(node_dir):
        return True
    if not _connected_to(tagged_pids(node_dir), head):
        return False
    with contextlib.suppress(OSError):
        write_file(node_dir / "joined", f"{_launch_id(node_dir)}\n")
    return True


def seen_joined(node_dir: Path) -> bool:
    """Whether this launch's processes were seen connected to the head (the `joined` marker, written
    by a status poll or by run.sh's watcher)."""
    launch_id = _launch_id(node_dir)
    try:
        return launch_id is not None and (node_dir / "joined").read_text().strip() == launch_id
    except OSError:
        return False


def watch_join(node_dir: Path, every_s: float = JOIN_WATCH_S) -> None:
    """Started by a worker's run.sh beside a user's command: look for the connection to the head a few
    times a second until it is seen or the command ends. A short job (a test, an all-reduce of a few
    seconds) joins and ends between two of the launcher's polls; without this its join is never
    seen and the world check can only say it could not tell. Its own environment carries no launch
    tag, so it is not one of the launch's processes (tagged_pids), but it is in run.sh's process
    group, so a stop ends it too. It gives up a minute after the launcher's --world-timeout: by then
    the launcher has judged the node (a script that never connects is not scanned for hours)."""
    info = _read_json(node_dir / "launch.json")
    runner = _pid(node_dir)
    timeout_s = float((info or {}).get("world_timeout_s") or 600.0) + 60.0
    deadline = time.monotonic() + timeout_s
    while not (node_dir / "exit").exists() and (runner is None or _alive(runner)):
        if joined(node_dir, info) is not False or time.monotonic() > deadline:
            return
        time.sleep(every_s)


def _connected_to(pids: list[int], address: str) -> bool:
    """Whether one of `pids` has an established TCP connection to `address` (IPv4 or IPv6)."""
    import ipaddress

    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return False
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    if not inodes:
        return False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            # local, remote ("hex address:hex port"), state 01 = ESTABLISHED, ..., inode at 9
            if len(fields) < 10 or fields[3] != "01" or fields[9] not in inodes:
                continue
            remote = _proc_net_address(fields[2].split(":")[0])
            if remote == wanted or getattr(remote, "ipv4_mapped", None) == wanted:
                return True
    return False


def _proc_net_address(hexed: str):  # -> ipaddress.IPv4Address | IPv6Address
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in the host's byte order."""
    import ipaddress

    raw = bytes.fromhex(hexed)
    words = b"".join(
        raw[i : i + 4][::-1] if sys.byteorder == "little" else raw[i : i + 4] for i in range(0, len(raw), 4)
    )
    return ipaddress.ip_address(words)


def _log_age(node_dir: Path) -> float | None:
    try:
        return max(0.0, time.time() - (node_dir / "log").stat().st_mtime)
    except OSError:
        return None


#: How long py-spy may take over one rank (it pauses the rank while it reads its stack).
PY_SPY_TIMEOUT_S = 10.0


def _py_spy(venv_bin: str) -> str | None:
    import shutil

    for candidate in (Path(venv_bin) / "py-spy", shutil.which("py-spy")):
        if candidate and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _py_spy_dump(spy: str, pid: int, *options: str) -> tuple[str, str]:
    """(py-spy's dump of `pid`, '') or ('', why not): its last error line, or that it timed out."""
    import subprocess

    try:
        done = subprocess.run(
            [spy, "dump", "--pid", str(pid), *options],
            capture_output=True,
            text=True,
            timeout=PY_SPY_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return "", f"py-spy did not answer within {PY_SPY_TIMEOUT_S:g} s"
    except OSError as err:
        return "", f"py-spy could not run: {err}"
    if done.returncode == 0 and done.stdout.strip():
        return done.stdout.strip(), ""
    lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
    return "", f"py-spy failed: {lines[-1][:300] if lines else f'exit code {done.returncode}'}"


def stacks(node_dir: Path, venv_bin: str) -> dict[str, str]:
    """rank -> the Python stack of each live rank of the bundled trainer.

    py-spy (if installed in the venv or on PATH, and allowed to attach without root) gives native and
    Python frames; otherwise the rank's own faulthandler writes its threads' stacks when it gets
    SIGUSR1 (trainer.node.progress registers that; no ptrace, no root)."""
    found: dict[str, str] = {}
    launch_id = _launch_id(node_dir)
    spy = _py_spy(venv_bin)
    for record in progress(node_dir):
        pid, rank = int(record.get("pid") or 0), str(record.get("rank"))
        if not pid or f"{TAG_VARIABLE}={launch_id}".encode() not in _environ(pid):
            continue  # not this launch's process (gone, or the pid was reused)
        if spy:
            dump, _ = _py_spy_dump(spy, pid)
            if dump:
                found[rank] = f"(py-spy)\n{dump}"
                continue
        stack_file = record.get("stack_file")
        if record.get("stack_signal") != "SIGUSR1" or not stack_file:
            continue
        path = Path(stack_file)
        before = path.stat().st_size if path.exists() else 0
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            continue
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            time.sleep(0.2)
            if path.exists() and path.stat().st_size > before:
                time.sleep(0.3)  # the dump is written in one go; give it a moment to finish
                break
        try:
            with open(path, "rb") as handle:
                handle.seek(before)
                text = handle.read(64 * 1024).decode("utf-8", "replace").strip()
        except OSError:
            text = ""
        if text:
            found[rank] = f"(faulthandler)\n{text}"
    return found


# --- where each rank's Python is at a stall (a user's command: no faulthandler of ours) -----------

#: The frames kept of a rank's stack (innermost first), and how many of them get their source line.
STACK_FRAMES = 24
SOURCE_LINES = 3
#: A rank's other threads reported with its stack, and the innermost frames of each.
OTHER_THREADS = 6
OTHER_THREAD_FRAMES = 4
#: Yama's ptrace_scope (kernel.yama.ptrace_scope): who may attach a debugger.
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"


def _ptrace_scope() -> int | None:
    try:
        return int(Path(YAMA_SCOPE).read_text().strip())
    except (OSError, ValueError):
        return None  # no Yama: any process of the account may attach


def stack_blocker(spy: str | None, scope: int | None) -> str:
    """Why no rank's stack can be read on this node ('' where py-spy may try)."""
    if spy is None:
        return (
            "py-spy is not installed in the training venv (the project's train extra has it: provision "
            "the nodes again)"
        )
    if scope is not None and scope >= 2:
        who = "only root" if scope == 2 else "no process"
        return (
            f"kernel.yama.ptrace_scope is {scope} on this node ({who} may attach a debugger): the ranks' "
            "stacks cannot be read as the training user; the culprit is named by process state only"
        )
    return ""


def _source_line(path: str, number: int) -> str:
    """Line `number` of the file `path` (what the frame runs), stripped; '' where it cannot be read."""
    if number < 1 or not path.endswith(".py"):
        return ""
    try:
        with open(path, encoding="utf-8", errors="replace") as source:
            for index, line in enumerate(source, 1):
                if index == number:
                    return line.strip()[:200]
    except OSError:
        pass
    return ""


def _dumped_threads(dump: str) -> list[dict]:
    threads = json.loads(dump)
    return [t for t in threads if isinstance(t, dict)] if isinstance(threads, list) else []


def _main_thread(threads: list[dict], pid: int) -> dict | None:
    """The main thread: the one whose OS thread id is the pid (else the one named MainThread)."""
    main = next((t for t in threads if t.get("os_thread_id") == pid), None)
    main = main or next((t for t in threads if t.get("thread_name") == "MainThread"), None)
    return main or (threads[0] if threads else None)


def _thread_frames(thread: dict, pid: int, limit: int = STACK_FRAMES) -> list[dict]:
    """A thread's frames (innermost first): name, file, line, and the source line of the innermost
    frame and of the first frames of the job's own code (outside any installed package: the caller of
    a collective), SOURCE_LINES at most."""
    frames, sources = [], 0
    for frame in (thread.get("frames") or [])[:limit]:
        if not isinstance(frame, dict):
            continue
        path, line = str(frame.get("filename") or ""), frame.get("line")
        line = line if isinstance(line, int) else 0
        entry = {"name": str(frame.get("name") or "?"), "file": path, "line": line}
        if sources < SOURCE_LINES and (not frames or "-packages/" not in path):
            with contextlib.suppress(OSError):  # a script named relative to the rank's directory
                path = path if path.startswith("/") else os.path.join(os.readlink(f"/proc/{pid}/cwd"), path)
            entry["code"] = _source_line(path, line)
            sources += 1
        frames.append(entry)
    return frames


def thread_stacks(dump: str, pid: int) -> tuple[list[dict], list[dict]]:
    """From one `py-spy dump --json`: the main thread's frames (_thread_frames), and every other thread
    with Python frames ({"name", "frames"}, OTHER_THREADS at most, OTHER_THREAD_FRAMES frames each):
    where the main thread waits on one of those (a join, a queue, a lock), the stuck place is there."""
    threads = _dumped_threads(dump)
    main = _main_thread(threads, pid)
    if main is None:
        return [], []
    others = []
    for thread in threads:
        if len(others) == OTHER_THREADS:
            break
        if thread is main or not (frames := _thread_frames(thread, pid, OTHER_THREAD_FRAMES)):
            continue
        others.append(
            {"name": str(thread.get("thread_name") or thread.get("os_thread_id") or "?"), "frames": frames}
        )
    return _thread_frames(main, pid), others


def add_stacks(records: list[dict], venv_bin: str) -> None:
    """Each running or sleeping rank's Python stack (thread_stacks), its main thread's frames as
    `stack` and its other threads' as `threads`; or why not as `stack_error`.
    For a stall of a user's command, whose ranks register no stack dump of ours: py-spy reads it,
    pausing the rank a moment. A rank stopped, blocked (py-spy would wait on a rank in state D) or
    exited is left out: its state says more."""
    ranks = [r for r in records if r.get("rank") is not None and r.get("state") not in TELLING_STATES]
    if not ranks:
        return
    spy, scope = _py_spy(venv_bin), _ptrace_scope()
    blocker = stack_blocker(spy, scope)
    for record in ranks:
        if blocker or spy is None:
            record["stack_error"] = blocker
            continue
        try:
            owner = os.stat(f"/proc/{record['pid']}").st_uid
        except OSError:
            continue  # gone meanwhile
        if os.geteuid() == 0 and owner != 0:
            # Root neither attaches to another account's process nor reads the files it names.
            record["stack_error"] = "not read as root: the stacks are read as the training user"
            continue
        dump, error = _py_spy_dump(spy, record["pid"], "--json")
        try:
            frames, threads = thread_stacks(dump, record["pid"]) if dump else ([], [])
        except ValueError:
            frames, error = [], "py-spy's answer was not JSON"
        if frames:
            record["stack"] = frames
            if threads:
                record["threads"] = threads
            continue
        if scope == 1 and not error.startswith("py-spy did not"):
            # Attaching needs the rank's leave under ptrace_scope 1 (trainer/stack_access.py).
            error += (
                " (kernel.yama.ptrace_scope is 1: a rank allows its account's py-spy only where it runs "
                "the training venv's python, whose clustertrain-stack-access.pth asks for it)"
            )
        record["stack_error"] = error or "py-spy found no Python stack"


# --- what the kernel says of each rank at a stall (the culprit by its process state) ---------------

#: /proc/<pid>/stat states a stall report singles out (proc(5)): stopped by a signal or a debugger,
#: in uninterruptible sleep, exited but not yet reaped. R and S run or wait, as a collective's peers do.
TELLING_STATES = ("T", "t", "D", "Z")
#: System calls a process in state D may be blocked in whose argument names what it waits on: number ->
#: (name, the argument's index, "fd" or "path"), for the two machines cluster nodes run.
WAITED_CALLS = {
    "x86_64": {
        0: ("read", 0, "fd"), 1: ("write", 0, "fd"), 2: ("open", 0, "path"), 4: ("stat", 0, "path"),
        5: ("fstat", 0, "fd"), 6: ("lstat", 0, "path"), 17: ("pread64", 0, "fd"), 18: ("pwrite64", 0, "fd"),
        19: ("readv", 0, "fd"), 20: ("writev", 0, "fd"), 21: ("access", 0, "path"), 74: ("fsync", 0, "fd"),
        75: ("fdatasync", 0, "fd"), 217: ("getdents64", 0, "fd"), 257: ("openat", 1, "path"),
        262: ("newfstatat", 1, "path"), 269: ("faccessat", 1, "path"), 332: ("statx", 1, "path"),
        439: ("faccessat2", 1, "path"),
    },
    "aarch64": {
        48: ("faccessat", 1, "path"), 56: ("openat", 1, "path"), 61: ("getdents64", 0, "fd"),
        63: ("read", 0, "fd"), 64: ("write", 0, "fd"), 65: ("readv", 0, "fd"), 66: ("writev", 0, "fd"),
        67: ("pread64", 0, "fd"), 68: ("pwrite64", 0, "fd"), 79: ("newfstatat", 1, "path"),
        80: ("fstat", 0, "fd"), 82: ("fsync", 0, "fd"), 83: ("fdatasync", 0, "fd"), 291: ("statx", 1, "path"),
        439: ("faccessat2", 1, "path"),
    },
}  # fmt: skip
#: AT_FDCWD as /proc/<pid>/syscall prints a directory argument (32 bits).
AT_FDCWD = 0xFFFFFF9C


def _proc_text(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def _user_string(pid: int, address: int) -> str:
    """The NUL-ended string at `address` in the process's memory ('' where ptrace rights are missing)."""
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as memory:
            memory.seek(address)
            return memory.read(4096).split(b"\0", 1)[0].decode("utf-8", "replace")
    except (OSError, ValueError, OverflowError):
        return ""


def waited_on(pid: int) -> dict:
    """What a process in state D is blocked in: its system call (/proc/<pid>/syscall, readable with
    ptrace rights over it) and, where the call names one, the file: a descriptor's target or the path
    it passed (read from its memory, relative ones joined to the directory they are relative to)."""
    fields = _proc_text(pid, "syscall").split()
    if not fields or not fields[0].isdigit():
        return {"syscall": ""}  # not readable, or "running" / -1 (blocked outside a system call)
    number, args = int(fields[0]), [int(arg, 16) for arg in fields[1:7]]
    call = WAITED_CALLS.get(os.uname().machine, {}).get(number)
    if call is None or len(args) <= call[1]:
        return {"syscall": f"system call {number}"}
    name, index, kind = call
    target = ""
    with contextlib.suppress(OSError):
        if kind == "fd":
            target = os.readlink(f"/proc/{pid}/fd/{args[index]}")
        elif (target := _user_string(pid, args[index])) and not target.startswith("/"):
            at = args[0] & 0xFFFFFFFF if index else AT_FDCWD
            base = os.readlink(f"/proc/{pid}/cwd" if at == AT_FDCWD else f"/proc/{pid}/fd/{at}")
            target = os.path.join(base, target)
    return {"syscall": name, "waits_on": target}


def process_record(pid: int, environ: list[bytes]) -> dict | None:
    """A process as the kernel sees it: state, parent, rank (RANK in its environment, as torchrun
    gives each worker), command, the kernel function it sleeps in (wchan), and for state D what it
    waits on (waited_on)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        state, ppid = fields[0], int(fields[1])
    except (OSError, IndexError, ValueError):
        return None
    rank = next((v[5:].decode() for v in environ if v.startswith(b"RANK=")), "")
    wchan = _proc_text(pid, "wchan")  # "0": running, or not ours to see
    record = {
        "pid": pid,
        "ppid": ppid,
        "state": state,
        "rank": int(rank) if rank.isdigit() else None,
        "command": " ".join(_command(pid))[:200],
        "wchan": "" if wchan == "0" else wchan,
    }
    if state == "D":
        record.update(waited_on(pid))
    return record


def process_states(node_dir: Path, limit: int = 64) -> list[dict]:
    """At a stall, this node's part of the launch as the kernel sees it (process_record): one entry per
    rank (its main process, or a process of the rank that is stopped or in state D, a data loader's
    say, with `of_rank_pid`), then the processes without a rank that are stopped, in D or exited
    (torchrun's agent), or where no process has a rank (a command without torchrun) the command's own.
    Reads only: nothing is signalled. The processes are this launch's (its tag) and this node's (the
    node rank run.sh exports: loopback and simulated nodes share one machine's processes)."""
    records: dict[int, dict] = {}
    for proc, environ in node_processes(node_dir):
        if (record := process_record(int(proc.name), environ)) is not None:
            records[record["pid"]] = record
    return _rank_units(records)[:limit]


def node_processes(node_dir: Path) -> Iterator[tuple[Path, list[bytes]]]:
    """This launch's processes on this node (its tag, and the node rank run.sh exports): each one's
    /proc dir and environment, which a process of another account or launch does not show."""
    launch_id = _launch_id(node_dir)
    if launch_id is None:
        return
    marker = f"{TAG_VARIABLE}={launch_id}".encode()
    for proc in Path("/proc").glob("[0-9]*"):
        environ = _environ(proc.name)
        if marker in environ and _of_node(environ, node_dir):
            yield proc, environ


def _of_node(environ: list[bytes], node_dir: Path) -> bool:
    """A process of this node's part of the launch: the node rank run.sh exports is the node dir's (or
    the process has none)."""
    node_rank = f"NODE_RANK={node_dir.name.removeprefix('node-')}".encode()
    return node_rank in environ or not any(v.startswith(b"NODE_RANK=") for v in environ)


def _rank_units(records: dict[int, dict]) -> list[dict]:
    by_rank: dict[int, list[dict]] = {}
    for record in sorted(records.values(), key=lambda r: r["pid"]):
        if record["rank"] is not None:
            by_rank.setdefault(record["rank"], []).append(record)
    units = []
    for rank, group in sorted(by_rank.items()):
        main = next((r for r in group if records.get(r["ppid"], {}).get("rank") != rank), group[0])
        odd = next((r for r in group if r["state"] in TELLING_STATES), None)
        telling = odd is not None and main["state"] not in TELLING_STATES
        units.append({**odd, "of_rank_pid": main["pid"]} if telling else main)
    rankless = [r for r in sorted(records.values(), key=lambda r: r["pid"]) if r["rank"] is None]
    units += [r for r in rankless if r["state"] in TELLING_STATES]
    if not by_rank:
        units += [r for r in rankless if r["ppid"] not in records and r["state"] not in TELLING_STATES]
    return units


def stop(node_dir: Path, grace_s: float) -> dict:
    """TERM to run.sh's group (torchrun passes it on to its workers), KILL to whatever is left."""
    pid = _pid(node_dir)
    stopped = False
    if pid is not None and (_alive(pid) or tagged_pids(node_dir)):
        stopped = True
        (node_dir / "stop-requested").write_text(f"{time.time()}\n")
        _signal_group(pid, signal.SIGTERM)
        # A stopped process (state T: a stall's culprit) takes the TERM only once continued; each is
        # this launch's own (tagged_pids checks its tag) and this node's (another node's stop must not
        # continue it before that node has read its state).
        for victim in tagged_pids(node_dir):
            frozen = _proc_text(victim, "stat").rsplit(")", 1)[-1].split()[:1] == ["T"]
            if frozen and _of_node(_environ(victim), node_dir):
                _signal(victim, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        while tagged_pids(node_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        for _ in range(3):
            left = tagged_pids(node_dir)
            if not left:
                break
            for victim in left:
                _signal_group(victim, signal.SIGKILL)
                _signal(victim, signal.SIGKILL)
            time.sleep(0.5)
        # run.sh (untagged: its variables are exported after it started) writes the exit record
        # once its command is gone; wait a moment for it so the report says "exited", not "running".
        deadline = time.monotonic() + 3.0
        while _alive(pid) and not (node_dir / "exit").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
    result = status(node_dir, offset=None, tail=0)
    result["stopped"] = stopped
    return result


def _command(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode("utf-8", "replace").split("\0")[:-1]
    except OSError:
        return []


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def keep_previous_launch(node_dir: Path) -> int | None:
    """Rename the last launch's log and exit record to log.N / exit.N; N (None if there was none)."""
    import re

    if not (node_dir / "log").exists() and not (node_dir / "exit").exists():
        return None
    taken = [
        int(m.group(1)) for p in node_dir.iterdir() if (m := re.fullmatch(r"(?:log|exit)\.(\d+)", p.name))
    ]
    number = max(taken, default=0) + 1
    for name in ("log", "exit"):
        if (node_dir / name).exists():
            (node_dir / name).rename(node_dir / f"{name}.{number}")
    return number


# trainer.safe_files.write_file, copied: this runs without the package (tests/unit/test_safe_files.py).
def write_file(path: str | os.PathLike, data: str | bytes, mode: int = 0o644, tmp_name: str = "") -> None:
    """Write `path` whole, never through a link: `.NAME.tmp` (or `tmp_name`) beside it made exclusively,
    `mode` set before any byte, then renamed over `path`."""
    directory, name = os.path.split(os.fspath(path))
    tmp = os.path.join(directory, tmp_name or f".{name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a leftover of a killed writer, or a planted link: removed, not opened
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with open(fd, "wb") as handle:
            os.fchmod(fd, mode)  # from 0600 to `mode`, whatever the umask
            handle.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def append_record(launch_dir: Path, record: dict) -> None:
    """One line in the run's launch/history.jsonl (launches, restarts, stops), appended."""
    with open(launch_dir / HISTORY_FILE, "a") as handle:
        handle.write(json.dumps({"time": time.time(), **record}) + "\n")


# --- before the start ---------------------------------------------------------------------------


def interface_of_by_ioctl(address: str) -> str:
    """The interface whose primary IPv4 address is `address`, asked of the kernel directly: for nodes
    without iproute2 (a minimal image), where `ip` cannot be run."""
    import fcntl
    import socket
    import struct

    siocgifaddr = 0x8915
    loopback = ""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                answer = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
            if loopback_holds(socket.inet_ntoa(answer[20:24]) + "/8", address):
                loopback = name
    return loopback


def loopback_holds(assigned: str, address: str) -> bool:
    """Whether a loopback address `assigned` (ADDRESS/PREFIX) holds `address`: Linux answers every
    address of lo's prefix (127.0.0.0/8) on lo, so loopback "nodes" on one machine at 127.0.0.2,
    127.0.0.3, ... are on lo (preflight's interfaces check applies the same rule)."""
    import ipaddress

    try:
        network = ipaddress.ip_network(assigned, strict=False)
        return network.network_address.is_loopback and ipaddress.ip_address(address) in network
    except ValueError:
        return False


def interface_of(address: str) -> str:
    """The interface holding `address` ('' if none), from `ip -o addr show`: the one it is assigned
    to, else the loopback interface whose prefix holds it."""
    import subprocess

    try:
        listing = subprocess.run(
            ["ip", "-o", "addr", "show"], capture_output=True, text=True, check=True, timeout=20
        ).stdout
    except FileNotFoundError:
        return interface_of_by_ioctl(address)
    except (OSError, subprocess.SubprocessError):
        return ""
    loopback = ""
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[2] in ("inet", "inet6"):
            if fields[3].split("/")[0] == address:
                return fields[1].split("@")[0]
            if loopback_holds(fields[3], address):
                loopback = fields[1].split("@")[0]
    return loopback


def port_error(address: str, port: int) -> str:
    """'' if `port` can be bound on `address` (the rendezvous can listen there), else why not."""
    import socket

    with socket.socket() as sock:
        # As torch's TCPStore does: connections of a finished run in TIME_WAIT do not block it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((address, port))
        except OSError as err:
            return err.strerror or str(err)
    return ""


#: How long a peer has to answer a connect at a stall (a SYN dropped by a firewall is never answered;
#: a reachable peer answers within a round trip, with the connection or a refusal).
REACH_TIMEOUT_S = 2.0


def reach(address: str, port: int, timeout_s: float = REACH_TIMEOUT_S) -> str:
    """Whether `address` answers a TCP connect on `port`: `answers` (connected, or refused: its kernel
    sent the reset back, so the path is open), `no answer` (nothing came back within `timeout_s`: the
    packets are dropped on the way or at the peer, a partial partition when SSH still works), or the
    error (no route, ...)."""
    import errno
    import socket

    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return "answers"
    except ConnectionRefusedError:
        return "answers"
    except TimeoutError:
        return "no answer"
    except OSError as err:
        if err.errno in (errno.ETIMEDOUT, errno.EINPROGRESS):
            return "no answer"
        return err.strerror or str(err)


def reach_peers(peers: list, port: int) -> dict[str, str]:
    """At a stall: each peer's (host, address) answer to a connect on `port` (reach), all at once, so
    the whole check takes one timeout at most."""
    import threading

    answers: dict[str, str] = {}

    def one(host: str, address: str) -> None:
        answers[host] = reach(address, port)

    threads = [
        threading.Thread(target=one, args=(str(host), str(address)), daemon=True)
        for host, address in peers[:256]
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(REACH_TIMEOUT_S + 5)
    return answers


def previous_state(node_dir: Path) -> str:
    """'running' if a trainer of this run's previous launch still runs on this node."""
    if _launch_id(node_dir) is None or _pid(node_dir) is None:
        return "none"
    if (node_dir / "exit").exists():
        return "exited"
    return "running" if tagged_pids(node_dir) else "vanished"


def infiniband_devices() -> list[str]:
    """The InfiniBand/RoCE devices the kernel lists (mlx5_0, ...): NCCL_IB_DISABLE=auto reads them."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def check(request: dict) -> str:
    """'' if the command can start here, else the problem and its fix: the working directory must be
    enterable and the program found, as the training user, with the PATH run.sh gives it."""
    import pwd
    import shutil

    user = pwd.getpwuid(os.geteuid()).pw_name
    workdir = Path(request["workdir"])
    if not workdir.is_dir():
        return (
            f"training_workdir {workdir} does not exist on this node: create it (on the shared dir it "
            "exists everywhere), or set training_workdir to a directory that does"
        )
    if not os.access(workdir, os.R_OK | os.X_OK):
        return (
            f"training_workdir {workdir} cannot be entered by the training user {user}: make it "
            f"readable and searchable by {user} (chown/chmod), or set another training_workdir"
        )
    program = request["program"]
    search_path = f"{request['venv_bin']}:{os.environ.get('PATH', os.defpath)}"
    if "/" in program:
        found = workdir / program
        if not found.is_file():
            return f"the command's program {program} does not exist (looked in {workdir})"
        if not os.access(found, os.X_OK):
            return (
                f"the command's program {found} is not executable by {user}: chmod +x it, or start it "
                f"through its interpreter (e.g. -- bash {program})"
            )
    elif shutil.which(program, path=search_path) is None:
        return (
            f"the command's program {program!r} is not found for {user} on PATH {search_path}: "
            "install it in the training venv, or give its full path"
        )
    script = request.get("script") or ""
    if script and not (workdir / script).is_file():
        return (
            f"the command's script {script} is not in {workdir} on this node (training_workdir: where "
            f"the command runs, not where you typed it): copy your code onto the shared dir, e.g. trainer "
            f"push -i INVENTORY ./{Path(script).parts[0]} --kind code, and give the path it prints (or set "
            "training_workdir to the directory that holds it on every node)"
        )
    if script and not os.access(workdir / script, os.R_OK):
        return f"the command's script {workdir / script} cannot be read by the training user {user}: chmod it"
    return ""


def probe(request: dict) -> dict:
    import pwd

    venv = Path(request["venv"])
    user = pwd.getpwuid(os.geteuid()).pw_name
    training_user = request.get("training_user") or user
    taken: dict = {}
    if request.get("lock") and training_user == user:
        # The run's lock first, as the training user only (its files are that user's): a second
        # launch of the run is refused before anything is probed. As another account, the lock is
        # left to the task after the probe (`lock_deferred`), which takes it as the training user.
        taken = lock(request["lock"])
        if not taken.get("acquired"):
            return {"user": user, "become": False, "lock": taken}
    # The bundled trainer needs torchrun and trainer; a user's own command only the venv's python
    # (this helper runs with it) and whatever the command itself starts.
    missing = [name for name in request["need"] if not os.access(venv / "bin" / name, os.X_OK)]
    command_check = request.get("check")
    result = {
        "user": user,
        "become": training_user != user,
        "venv_missing": missing,
        "iface": interface_of(request["address"]) if request.get("iface_auto") else "",
        "port_error": port_error(request["address"], int(request["port"])) if request.get("port") else "",
        "previous": previous_state(Path(request["node_dir"])),
        "ib_devices": infiniband_devices(),
        # As the training user only: another account's view of the working dir says nothing.
        "checked": bool(command_check) and training_user == user,
        "check_error": check(command_check) if command_check and training_user == user else "",
        "lock": taken,
        "lock_deferred": bool(request.get("lock")) and not taken,
    }
    return result


# --- the start ----------------------------------------------------------------------------------


def stale_extension_locks() -> list[str]:
    """A torch extension build (DeepSpeed's ops) killed midway leaves a lock no process holds; every
    DeepSpeed start on this node would then wait on it forever, with no output. Checked as the
    training user (start runs as it), so its own processes and cache dir are what is looked at:
    each stale lock's file and fix (trainer.torch_extensions, preflight's deepspeed_ops check)."""
    import site
    import socket

    # This helper runs with `python -S`; the check needs the venv's site-packages: the trainer
    # package, and trainer_env's .pth that sets TORCH_EXTENSIONS_DIR (once per start, not per poll).
    site.main()
    try:
        from trainer.torch_extensions import check as extensions_check
        from trainer.torch_extensions import stale_lock_fix
    except ImportError:  # a node venv older than the check
        return []
    host = socket.gethostname()
    return [
        f"stale build lock {lock['path']} (no process holds it): {stale_lock_fix(lock, host)}"
        for lock in extensions_check()["stale"]
    ]


def start(request: dict, program: str) -> dict:
    """Keep the previous launch's log, clear its state, write the run's files (the head gets them),
    the node's secret variables, run.sh, launch.json and this helper; then start run.sh detached
    (setsid: its own session and process group) and wait for its pid file."""
    if stale := stale_extension_locks():
        raise Failure("; ".join(stale))
    node_dir = Path(request["node_dir"])
    kept, written = _write_launch(request, program, node_dir)
    _start_run_sh(request, node_dir)
    result = status(node_dir)
    result.update(written=written, kept_previous_as=kept)
    return result


def _write_launch(request: dict, program: str, node_dir: Path) -> tuple[int | None, list[str]]:
    """start's writes: the previous launch kept and its state cleared, then this launch's files.
    (What the previous log was kept as, the names of the run's files written.)"""
    import shlex
    import shutil

    launch_dir = Path(request["launch_dir"])
    # A restart by `trainer attach`: the node's run.sh, secret-env and the run's files stay as the
    # launcher wrote them.
    reuse = bool(request.get("reuse"))
    if reuse and not (node_dir / "run.sh").is_file():
        raise Failure(
            f"{node_dir}/run.sh is missing: there is nothing to restart here; relaunch with `trainer launch`"
        )
    node_dir.mkdir(parents=True, exist_ok=True)
    kept = keep_previous_launch(node_dir)
    for name in ("pid", "stop-requested", "cursor", "cursor.tmp"):
        (node_dir / name).unlink(missing_ok=True)
    # The ranks' progress and stack files belong to the last launch (a stall's stacks are in the
    # history record already).
    shutil.rmtree(node_dir / "progress", ignore_errors=True)
    (node_dir / "progress").mkdir()
    (node_dir / "launch-id").write_text(request["launch_id"] + "\n")
    secrets = request.get("secret_env") or {}
    if secrets and not reuse:
        # Sourced by run.sh; names were checked on the controller, values are quoted here.
        write_file(
            node_dir / "secret-env",
            "".join(f"export {name}={shlex.quote(str(value))}\n" for name, value in sorted(secrets.items())),
            0o600,
        )
    elif not reuse:
        (node_dir / "secret-env").unlink(missing_ok=True)
    written = []
    for name, text in sorted((request.get("files") or {}).items()):
        # config.yaml may hold a secret (the webhook URL): only the training user reads it.
        write_file(launch_dir / name, text, 0o600 if name == "config.yaml" else 0o644)
        written.append(name)
    write_file(node_dir / "node_ctl.py", program)
    if not reuse:
        write_file(node_dir / "run.sh", request["run_sh"], 0o755)
    write_file(node_dir / "launch.json", json.dumps(request.get("info") or {}, indent=1) + "\n")
    if request.get("record"):
        append_record(launch_dir, request["record"])
    return kept, written


def _start_run_sh(request: dict, node_dir: Path) -> None:
    """Once the files start waits for are visible, run.sh detached; back once its pid file is there."""
    import subprocess

    timeout_s = float(request.get("wait_timeout_s") or 60.0)
    deadline = time.monotonic() + timeout_s
    # On an NFS mount the head's files can take a moment to appear.
    for path in map(Path, request.get("wait_for") or []):
        while not path.exists():
            if time.monotonic() > deadline:
                raise Failure(
                    f"{path} is not visible on this node after {timeout_s:.0f} s: is the shared dir mounted?"
                )
            time.sleep(0.05)
    # Not Ansible's own variables: with a local connection they include the controller's run marker
    # (trainer.controller.runner ends every process carrying it when the playbook ends; the trainer
    # must live on).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ANSIBLE_", "AWX_", "RUNNER_", "CLUSTERTRAIN_RUNNER_"))
    }
    with open(os.devnull, "rb") as null_in, open(os.devnull, "wb") as null_out:
        subprocess.Popen(
            ["/bin/bash", str(node_dir / "run.sh")],
            cwd=node_dir,
            env=env,
            stdin=null_in,
            stdout=null_out,
            stderr=null_out,
            start_new_session=True,
        )
    while _pid(node_dir) is None:
        if time.monotonic() > deadline:
            raise Failure(f"run.sh in {node_dir} did not start within {timeout_s:.0f} s")
        time.sleep(0.05)


# --- the run's lock ------------------------------------------------------------------------------


def lock(request: dict) -> dict:
    """The run's lock, `<launch dir>/lock` on the head: one launcher per run name at a time.

    acquire: made atomically (a complete file linked into place: it exists whole or not at all, on
    the head's own disk); taken again by the same holder (its `token`: a launcher keeps it across
    its restarts) without a change. Held by another: not acquired, and its holder is returned; with
    `take_over` equal to that holder's token (the controller judged it dead, `--force`), it is moved
    aside and replaced, recorded in history.jsonl. release: removed if the caller holds it.
    inspect: the holder, if any."""
    launch_dir = Path(request["launch_dir"])
    path = launch_dir / LOCK_FILE
    token = str(request.get("token") or "")
    action = request.get("action")
    if action == "inspect":
        return {"holder": _read_json(path) if path.exists() else None}
    if action == "release":
        holder = _read_json(path)
        if holder is not None and holder.get("token") == token:
            path.unlink(missing_ok=True)
            return {"released": True}
        return {"released": False, "holder": holder}
    if action != "acquire" or not token:
        raise Failure(f"bad lock request {action!r}")
    launch_dir.mkdir(parents=True, exist_ok=True)
    mine = {**(request.get("holder") or {}), "token": token, "taken_at": time.time()}
    tmp = launch_dir / f".lock.{token}"
    write_file(tmp, json.dumps(mine) + "\n")
    try:
        try:
            os.link(tmp, path)
            return {"acquired": True, "holder": mine}
        except FileExistsError:
            pass
        current = _read_json(path)
        if current is not None and current.get("token") == token:
            return {"acquired": True, "holder": current}
        stale = request.get("take_over")
        if stale is not None and (current or {}).get("token", "") == stale:
            aside = launch_dir / f".lock.taken.{token}"
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                return {"acquired": False, "holder": _read_json(path), "changed": True}
            moved = _read_json(aside)
            if (moved or {}).get("token", "") != stale:
                # Another launcher's fresh lock came in between: put it back, take nothing.
                with contextlib.suppress(FileExistsError):
                    os.link(aside, path)
                aside.unlink(missing_ok=True)
                return {"acquired": False, "holder": moved, "changed": True}
            try:
                os.link(tmp, path)
            except FileExistsError:
                aside.unlink(missing_ok=True)
                return {"acquired": False, "holder": _read_json(path), "changed": True}
            aside.unlink(missing_ok=True)
            append_record(launch_dir, {"event": "lock_taken_over", "from": moved, "by": mine})
            return {"acquired": True, "holder": mine, "took_over": moved}
        return {"acquired": False, "holder": current if current is not None else {}}
    finally:
        tmp.unlink(missing_ok=True)


class Failure(Exception):
    """The request cannot be done; the message says why (and the fix)."""


def serve(request: dict) -> int:
    """Answer one request from the launcher (JSON on stdin, see the module's docstring)."""
    program = request.pop("program", "")
    op = request.get("op")
    try:
        if op == "probe":
            result = probe(request)
        elif op == "check":
            result = {"check_error": check(request["check"])}
        elif op == "lock":
            result = lock(request)
        elif op == "start":
            result = start(request, program)
        elif op == "status":
            result = status(
                Path(request["node_dir"]),
                request.get("offset"),
                int(request.get("tail") or 0),
                float(request.get("wait") or 0.0),
                bool(request.get("quiet")),
                usage=bool(request.get("activity")),
            )
        elif op == "states":
            states = process_states(Path(request["node_dir"]))
            if request.get("stacks"):  # a user's command: where each rank's Python is (py-spy)
                add_stacks(states, str(request.get("venv_bin") or ""))
            result = {"proc_states": states}
            if request.get("peers"):  # a partial partition: who answers this node on the port
                port = int(request["port"])
                result["reach"] = {"port": port, "peers": reach_peers(request["peers"], port)}
        elif op == "stop":
            node_dir = Path(request["node_dir"])
            # A stall's process states first: the stacks' SIGUSR1 and the stop change them.
            states = process_states(node_dir) if request.get("states") else None
            found = stacks(node_dir, request.get("venv_bin", "")) if request.get("stacks") else {}
            if found:
                # Kept with the node's logs: the evidence of a stall survives the relaunch.
                write_file(
                    node_dir / f"stacks-{_launch_id(node_dir)}.json", json.dumps(found, indent=1) + "\n"
                )
            result = stop(node_dir, float(request.get("grace_s", 10.0)))
            result["stacks"] = found
            if states is not None:
                result["proc_states"] = states
            if request.get("output_dir"):
                with contextlib.suppress(OSError):
                    latest = latest_checkpoint_file(Path(request["output_dir"]))
                    result["latest_checkpoint"] = latest.read_text().strip()
            if request.get("record") and Path(request["launch_dir"]).is_dir():
                record = dict(request["record"])
                if request.get("stacks"):
                    record["stacks_in"] = f"node-N/stacks-{_launch_id(node_dir)}.json"
                append_record(Path(request["launch_dir"]), record)
        elif op == "pids":
            node_dir = Path(request["node_dir"])
            result = {"processes": [{"pid": pid, "command": _command(pid)} for pid in tagged_pids(node_dir)]}
        else:
            raise Failure(f"unknown request {op!r}")
    except (Failure, OSError) as err:
        print(json.dumps({"failed": True, "msg": str(err)}))
        return 1
    print(json.dumps(result))
    return 0


def main() -> int:
    node_dir, action = Path(sys.argv[1]), sys.argv[2]
    if action == "stop":
        result = stop(node_dir, float(sys.argv[3]) if len(sys.argv) > 3 else 10.0)
    elif action == "pids":
        result = {"processes": [{"pid": pid, "command": _command(pid)} for pid in tagged_pids(node_dir)]}
    elif action == "watch-join":
        watch_join(node_dir)
        return 0
    else:
        result = status(node_dir, offset=None, tail=20)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
