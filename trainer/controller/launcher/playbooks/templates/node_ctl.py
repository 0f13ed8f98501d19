"""Report on (or stop) the trainer `trainer launch` started on this node; copied into the node's dir.

    python node_ctl.py NODE_DIR status   one JSON line: state, exit record, new log lines
    python node_ctl.py NODE_DIR peek     the state alone (the log cursor stays where it is)
    python node_ctl.py NODE_DIR stop     stop the process group (TERM, then KILL), then as status
    python node_ctl.py NODE_DIR check JSON   can the command start: {"workdir", "program", "venv_bin"}
    python node_ctl.py NODE_DIR prepare  keep the previous launch's log and exit record (log.N,
                                         exit.N), clear its state; write the run's files and the
                                         node's secret variables (JSON on stdin: {"launch_id",
                                         "launch_dir", "files", "secret_env"})
    python node_ctl.py NODE_DIR start FILE...  start run.sh in its own session once FILEs are visible
    python node_ctl.py NODE_DIR pids     the live processes of this launch on this node (pid, command)

torchrun puts every worker in a session of its own, so a signal to run.sh's process group does not
reach them: every process of the launch carries CLUSTERTRAIN_LAUNCH_ID (from `launch-id`) in its
environment, and that is how they are all found, even after their parent is gone.

The node dir holds `pid` (the process group leader run.sh writes), `log` (the command's output),
`exit` (JSON written by run.sh when the command ends), `cursor` (how far `status` has read `log`,
so each poll returns only new lines) and `secret-env` (the secret variables, mode 0600). A relaunch
renames the last launch's `log` and `exit` to `log.N` and `exit.N` (N = 1, 2, ... in launch order):
the evidence of a failure survives every later launch. Standard library only: it runs with the
node's venv python.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

#: Log bytes returned per poll at most; the rest comes with the next polls.
MAX_CHUNK = 256 * 1024
TAG_VARIABLE = "CLUSTERTRAIN_LAUNCH_ID"


def _launch_id(node_dir: Path) -> str | None:
    try:
        return (node_dir / "launch-id").read_text().strip() or None
    except OSError:
        return None


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


def _new_lines(node_dir: Path) -> list[str]:
    cursor_file = node_dir / "cursor"
    try:
        offset = int(cursor_file.read_text())
    except (OSError, ValueError):
        offset = 0
    try:
        with open(node_dir / "log", "rb") as log:
            log.seek(offset)
            chunk = log.read(MAX_CHUNK)
    except OSError:
        return []
    # Only whole lines; a partial last line waits for the next poll (unless the chunk is full).
    end = chunk.rfind(b"\n") + 1 if len(chunk) < MAX_CHUNK else len(chunk)
    tmp = node_dir / "cursor.tmp"
    tmp.write_text(str(offset + end))
    tmp.replace(cursor_file)
    return chunk[:end].decode("utf-8", "replace").splitlines()


def status(node_dir: Path, read_lines: bool = True) -> dict:
    pid = _pid(node_dir)
    exit_record = _read_json(node_dir / "exit")
    if exit_record is not None:
        state = "exited"
    elif pid is None:
        state = "starting"
    elif _alive(pid) or tagged_pids(node_dir):
        state = "running"
    else:
        # Gone without run.sh writing its exit record: the whole process group was killed.
        state = "vanished"
    return {
        "state": state,
        "pid": pid,
        "exit": exit_record,
        "stop_requested": (node_dir / "stop-requested").exists(),
        "lines": _new_lines(node_dir) if read_lines else [],
        "time": time.time(),
    }


def stop(node_dir: Path, grace_s: float) -> dict:
    """TERM to run.sh's group (torchrun passes it on to its workers), KILL to whatever is left."""
    pid = _pid(node_dir)
    stopped = False
    if pid is not None and (_alive(pid) or tagged_pids(node_dir)):
        stopped = True
        (node_dir / "stop-requested").write_text(f"{time.time()}\n")
        _signal_group(pid, signal.SIGTERM)
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
    result = status(node_dir)
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


def write_private(path: Path, text: str) -> None:
    """Write `path` readable by this user only, atomically (never a moment with looser modes)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
        handle.write(text)
    tmp.replace(path)


def prepare(node_dir: Path, payload: dict) -> dict:
    """Keep the previous launch's log, clear its state, write the run's files (the head gets them)
    and the node's secret variables."""
    kept = keep_previous_launch(node_dir)
    for name in ("pid", "cursor", "cursor.tmp", "stop-requested"):
        (node_dir / name).unlink(missing_ok=True)
    (node_dir / "launch-id").write_text(payload["launch_id"] + "\n")
    secrets = payload.get("secret_env") or {}
    if secrets:
        # Sourced by run.sh; names were checked on the controller, values are quoted here.
        write_private(
            node_dir / "secret-env",
            "".join(f"export {name}={shlex.quote(str(value))}\n" for name, value in sorted(secrets.items())),
        )
    else:
        (node_dir / "secret-env").unlink(missing_ok=True)
    launch_dir = Path(payload["launch_dir"])
    written = []
    for name, text in sorted((payload.get("files") or {}).items()):
        target = launch_dir / name
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.unlink(missing_ok=True)
        # config.yaml may hold a secret (the webhook URL): only the training user reads it.
        mode = 0o600 if name == "config.yaml" else 0o644
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "w") as handle:
            handle.write(text)
        tmp.replace(target)
        written.append(name)
    return {"state": "prepared", "written": written, "kept_previous_as": kept}


def check(request: dict) -> dict:
    """Refuse a command that cannot start here, before any node starts: the working directory must
    be enterable and the program found, as the training user, with the PATH run.sh gives it."""
    user = pwd.getpwuid(os.geteuid()).pw_name
    workdir = Path(request["workdir"])
    if not workdir.is_dir():
        raise SystemExit(
            f"training_workdir {workdir} does not exist on this node: create it (on the shared dir it "
            "exists everywhere), or set training_workdir to a directory that does"
        )
    if not os.access(workdir, os.R_OK | os.X_OK):
        raise SystemExit(
            f"training_workdir {workdir} cannot be entered by the training user {user}: make it "
            f"readable and searchable by {user} (chown/chmod), or set another training_workdir"
        )
    program = request["program"]
    search_path = f"{request['venv_bin']}:{os.environ.get('PATH', os.defpath)}"
    if "/" in program:
        found = workdir / program
        if not found.is_file():
            raise SystemExit(f"the command's program {program} does not exist (looked in {workdir})")
        if not os.access(found, os.X_OK):
            raise SystemExit(
                f"the command's program {found} is not executable by {user}: chmod +x it, or start it "
                f"through its interpreter (e.g. -- bash {program})"
            )
    else:
        found = shutil.which(program, path=search_path)
        if found is None:
            raise SystemExit(
                f"the command's program {program!r} is not found for {user} on PATH {search_path}: "
                "install it in the training venv, or give its full path"
            )
    return {"workdir": str(workdir), "program": str(found), "user": user}


def start(node_dir: Path, wait_for: list[Path], timeout_s: float = 60.0) -> dict:
    """Start run.sh detached (setsid: its own session and process group) and wait for its pid file."""
    deadline = time.monotonic() + timeout_s
    # On an NFS mount the head's files can take a moment to appear.
    for path in wait_for:
        while not path.exists():
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"{path} is not visible on this node after {timeout_s:.0f} s: is the shared dir mounted?"
                )
            time.sleep(0.5)
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
            raise SystemExit(f"run.sh in {node_dir} did not start within {timeout_s:.0f} s")
        time.sleep(0.1)
    return status(node_dir, read_lines=False)


def main() -> int:
    node_dir, action = Path(sys.argv[1]), sys.argv[2]
    if action == "stop":
        result = stop(node_dir, float(sys.argv[3]) if len(sys.argv) > 3 else 10.0)
    elif action == "prepare":
        result = prepare(node_dir, json.load(sys.stdin))
    elif action == "start":
        result = start(node_dir, [Path(arg) for arg in sys.argv[3:]])
    elif action == "check":
        result = check(json.loads(sys.argv[3]))
    elif action == "pids":
        result = {"processes": [{"pid": pid, "command": _command(pid)} for pid in tagged_pids(node_dir)]}
    else:
        result = status(node_dir, read_lines=action != "peek")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
