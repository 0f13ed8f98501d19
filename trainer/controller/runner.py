"""The project's one way to run an Ansible playbook from Python: ansible-runner, events as they come.

API::

    from trainer.controller.runner import run_playbook

    result = run_playbook(
        "path/to/play.yml",               # absolute or relative to the current directory
        "inventory/local",                 # inventory directory or file
        extravars={"key": "value"},        # passed as -e @file, never on the command line
        on_event=print,                    # called on the caller's thread with each event dict, once
        cancel=threading.Event(),          # set it to stop the run (ansible-playbook is terminated)
        limit="head", tags="probe",        # optional --limit / --tags / --skip-tags (skip_tags=)
        on_message=handle,                 # messages of the playbook's action plugins (see below)
        on_tick=check_clock,               # called on the caller's thread about twice a second
    )
    result.status                          # "successful" | "failed" | "canceled" | "timeout"
    result.rc                              # ansible-playbook's exit code (254 when canceled)
    result.ok["localhost"]                 # [TaskResult, ...]: module return values in .result
    result.task_result("localhost", "Read the version")   # last result of that task on that host
    result.failed, result.unreachable      # host -> [TaskResult, ...]
    result.first_failure                   # the first failed/unreachable TaskResult, or None
    result.output                          # the tail of ansible-playbook's own output (syntax errors)

    early = prestart_playbook("play.yml", "inventory/local", {"key"})   # started now, values later
    ...                                    # meanwhile: work out the values
    run_playbook("play.yml", "inventory/local", extravars={"key": v}, prestarted=early)

Why it looks like this (the known ansible-runner traps):
- events are copied onto a queue by the runner's thread and handed to `on_event` on the caller's
  thread, so a slow handler (a live view) never stalls the run; events can repeat, so they are
  deduplicated by uuid;
- extra variables are values: written to ansible-playbook's -e file with every string that holds a
  template marker tagged !unsafe, so no value given here is rendered as a Jinja template;
- the run gets a temporary private_data_dir, removed afterwards: its `artifacts/<id>/command` file
  holds the run's whole environment, so only ANSIBLE_* variables and a short allow-list are passed
  on (the environment is filtered in the status handler, which ansible-runner calls with
  `runner_config=` before it writes that file and starts the process);
- `ansible-playbook` is looked up on PATH, so the running interpreter's bin directory goes first;
- ansible-runner turns host key checking off unless told otherwise; here it stays on unless the
  caller's own environment sets ANSIBLE_HOST_KEY_CHECKING;
- passwords (trainer.controller.access) reach ansible-playbook as its own options: password files by
  path, a typed sudo password as the answer to its --ask-become-pass prompt, set on the runner's config
  in memory in the status handler (given as `passwords=`, ansible-runner writes it to env/passwords);
  so no password is on a command line, in the environment, or in a file of the private dir;
- nothing per event is kept: ansible-runner writes no job_events files and no stdout file for these
  runs (the event handler says not to; `result.output` is the tail of the output, kept in memory),
  and events are deduplicated against a bounded window, so a watch of days keeps flat memory;
- messages that should not be Ansible events at all (a watch's poll every two seconds for days)
  go through a channel: with `on_message`, the playbook gets `runner_channel`, the path of a Unix
  socket in the private dir, where an action plugin writes JSON lines; each one is handed to
  `on_message` on the caller's thread, like an event, as a ChannelMessage that can be answered on its
  connection (`reply`: the launch's word to start);
- a canceled run's ansible-playbook outlives ansible-runner's kill (it runs in a session of its own),
  so every process of a run carries CLUSTERTRAIN_RUNNER_ID in its environment and whatever still
  carries it when the run ends is terminated. On a local connection that includes processes a task
  started: one that must outlive the run (a detached trainer) must drop that variable;
- SSH masters (ControlPersist: 60 s by Ansible's default, 120 s in the repo's ansible.cfg) would
  outlive every run by that long, and ssh writes its process title (`ssh: SOCKET [mux]`) over its
  environment, marker included: each run gets a socket dir of its own
  (ANSIBLE_SSH_CONTROL_PATH_DIR), and its masters, found by that dir in their title, end with the
  run. A ControlPath set by hand (ANSIBLE_SSH_CONTROL_PATH, ssh args, inventory) is left to its
  owner, masters included. Runs share no master, so each run opens one SSH connection per node.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainer.controller import access as access_options

#: Variables passed to ansible-playbook besides ANSIBLE_*: what SSH, podman and Python need to work.
ENV_ALLOW_LIST = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "TERM",
        "TMPDIR",
        "TZ",
        "SSH_AUTH_SOCK",
        "XDG_RUNTIME_DIR",
        "CONTAINERS_CONF",
        "CONTAINER_HOST",
        "VIRTUAL_ENV",
        # set by ansible-runner itself for its callback plugin
        "AWX_ISOLATED_DATA_DIR",
        "RUNNER_OMIT_EVENTS",
        "RUNNER_ONLY_FAILED_EVENTS",
        "PYTHONUNBUFFERED",
    }
)

#: Settings for every playbook run here unless the caller or the user's environment gives them.
#: ansible-runner runs ansible-playbook in the playbook's directory, so no ansible.cfg of the user's
#: current directory applies (~/.ansible.cfg still does): without these, a packaged playbook would
#: run 5 hosts at a time. Forks bound concurrency only; a small inventory starts as many workers as it
#: has hosts.
PLAYBOOK_DEFAULTS = {"ANSIBLE_FORKS": "50", "ANSIBLE_RETRY_FILES_ENABLED": "False"}
#: Ansible's main process checks on its running tasks every `internal_poll_interval` seconds; its
#: default, 0.001, wakes it about 700 times a second for as long as a task runs (`trainer launch`'s
#: watch runs as long as the training: 5% of a core, taken from the trainers' start-up where the
#: controller is a node). 0.01 s notices a task's end within 10 ms at a tenth of the CPU. Ansible reads
#: this only from a config file: it is given in one where the run would read no config file at all.
INTERNAL_POLL_CONFIG = "[defaults]\ninternal_poll_interval = 0.01\n"
#: How often (seconds) ansible-runner looks at the cancel flag.
CANCEL_POLL_S = 0.5
#: How often (seconds) `on_tick` is called while a run is going.
TICK_S = 0.5
#: Event uuids remembered to drop repeats (ansible-runner repeats an event only right after itself).
SEEN_EVENTS = 4096
#: Characters of ansible-playbook's own output kept for `result.output`.
OUTPUT_TAIL = 4000
PRIVATE_DIR_PREFIX = "clustertrain-runner-"
#: The longest Unix socket path bound where asked (Linux's sun_path holds 107 bytes and a NUL).
MAX_SOCKET_PATH = 100
#: Marks the processes of one run: ansible-runner's cancel kills the process it spawned, but
#: ansible-playbook (ansible-core 2.19) runs in a session of its own and outlives that, with its
#: workers and, on local connections, the modules they run.
RUN_MARKER = "CLUSTERTRAIN_RUNNER_ID"
#: Where a run's SSH masters put their sockets (its own dir; see the module's docstring).
SSH_CONTROL_DIR_ENV = "ANSIBLE_SSH_CONTROL_PATH_DIR"
#: The longest such dir: Ansible names a socket with 10 characters after it, and ssh binds it first
#: under that name plus 17 more (`.` and 16 random characters).
MAX_SSH_CONTROL_DIR = MAX_SOCKET_PATH - 28
#: A prestarted run's late variables (PrestartedRun): each is this template, read by this lookup from
#: the file named in this environment variable of ansible-playbook's.
LATE_VARS_LOOKUP = "runner_late_vars"
LATE_TEMPLATE = "{{{{ lookup('{lookup}', '{name}') }}}}"
LATE_VALUES_ENV = "CLUSTERTRAIN_RUNNER_LATE_VALUES"
LATE_VALUES_FILE = "late-values.json"
#: Names a late variable may have (it is written into a template).
LATE_NAME = re.compile(r"[a-z_][a-z0-9_]*")

#: How Ansible says a node's sudo wants a password it was not given, or a wrong one.
SUDO_PASSWORD_PROBLEM = re.compile(
    r"(missing|incorrect) (sudo|become|su) password|timeout .*privilege escalation", re.IGNORECASE
)
SUDO_PASSWORD_FIX = (
    "this node's sudo asks for a password: give it with --ask-become-pass or --become-password-file FILE "
    "(or ANSIBLE_BECOME_PASSWORD_FILE), or allow the account passwordless sudo"
)


def with_known_fix(text: str) -> str:
    """A task's failure text, with the fix appended where Ansible's words name a known cause."""
    if SUDO_PASSWORD_PROBLEM.search(text):
        return f"{text} (fix: {SUDO_PASSWORD_FIX})"
    return text


_RESULT_EVENTS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failed",
    "runner_on_unreachable": "unreachable",
    "runner_on_skipped": "skipped",
}


@dataclass(frozen=True)
class TaskResult:
    """One task's outcome on one host, with the module's return values (`result`)."""

    host: str
    task: str
    action: str
    status: str
    result: dict[str, Any] = field(repr=False)
    ignore_errors: bool = False

    @property
    def message(self) -> str:
        """The most telling text of a result: msg and stderr (a command's msg alone says little)."""
        parts = [str(self.result.get(key) or "").strip() for key in ("msg", "stderr")]
        text = ": ".join(p for p in parts if p) or str(self.result.get("stdout") or "").strip()
        return with_known_fix(text)


@dataclass
class PlaybookResult:
    """What a playbook run did, per host."""

    status: str
    rc: int
    results: list[TaskResult] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    output: str = ""

    def _by_status(self, status: str) -> dict[str, list[TaskResult]]:
        grouped: dict[str, list[TaskResult]] = {}
        for item in self.results:
            if item.status == status:
                grouped.setdefault(item.host, []).append(item)
        return grouped

    @property
    def ok(self) -> dict[str, list[TaskResult]]:
        return self._by_status("ok")

    @property
    def failed(self) -> dict[str, list[TaskResult]]:
        """Failures that stopped a host (failures under ignore_errors are left out)."""
        return {
            host: kept
            for host, items in self._by_status("failed").items()
            if (kept := [i for i in items if not i.ignore_errors])
        }

    @property
    def unreachable(self) -> dict[str, list[TaskResult]]:
        return self._by_status("unreachable")

    @property
    def first_failure(self) -> TaskResult | None:
        for item in self.results:
            if item.status == "unreachable" or (item.status == "failed" and not item.ignore_errors):
                return item
        return None

    @property
    def succeeded(self) -> bool:
        return self.status == "successful" and self.rc == 0

    def task_result(self, host: str, task: str) -> TaskResult | None:
        """The last result of the task named `task` on `host` (any status), or None."""
        for item in reversed(self.results):
            if item.host == host and item.task == task:
                return item
        return None


def filtered_environment(env: Mapping[str, str], bin_dir: str | None = None) -> dict[str, str]:
    """Keep ANSIBLE_* and the allow-list; put `bin_dir` first on PATH; keep host key checking on."""
    kept = {k: v for k, v in env.items() if k.startswith("ANSIBLE_") or k in ENV_ALLOW_LIST}
    if bin_dir:
        rest = [p for p in kept.get("PATH", os.defpath).split(os.pathsep) if p and p != bin_dir]
        kept["PATH"] = os.pathsep.join([bin_dir, *rest])
    if "ANSIBLE_HOST_KEY_CHECKING" not in os.environ:
        kept["ANSIBLE_HOST_KEY_CHECKING"] = "True"
    return kept


def reads_config_file(env: Mapping[str, str], cwd: Path) -> bool:
    """Whether ansible-playbook, run in `cwd` with `env`, finds a config file (ANSIBLE_CONFIG, then
    ansible.cfg in its directory, in the home directory, in /etc/ansible): a user's or the project's
    settings are never replaced, only an absent file is."""
    home = Path(env.get("HOME") or Path.home())
    return bool(env.get("ANSIBLE_CONFIG")) or any(
        path.is_file()
        for path in (cwd / "ansible.cfg", home / ".ansible.cfg", Path("/etc/ansible/ansible.cfg"))
    )


def _marked_processes(marker: str, ssh_control_dir: str | None = None) -> list[int]:
    """Our own processes whose environment holds `marker` (NAME=value), and the SSH masters of ours
    with their socket in `ssh_control_dir` (their title, which replaced their environment)."""
    wanted = marker.encode()
    title = f"ssh: {ssh_control_dir}/".encode() if ssh_control_dir else None
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if wanted in (proc / "environ").read_bytes().split(b"\0") or (
                title
                and (proc / "cmdline").read_bytes().startswith(title)
                and proc.stat().st_uid == os.geteuid()  # any process may take such a title
            ):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def _end_processes(marker: str, grace_s: float = 3.0, ssh_control_dir: str | None = None) -> None:
    """TERM what is left of a run (its SSH masters included), KILL what survives `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [pid for pid in _marked_processes(marker, ssh_control_dir) if pid != os.getpid()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
            time.sleep(0.1)


def _owner_text() -> str:
    """This process, as written into a private dir it owns: pid and start time (pids are reused)."""
    try:
        started = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = ""
    return f"{os.getpid()} {started}"


def _owner_alive(text: str) -> bool:
    try:
        pid, started = text.split()
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19] == started
    except (OSError, ValueError, IndexError):
        return False


def remove_stale_private_dirs(parent: str | None = None) -> list[str]:
    """Remove the private dirs of runs whose process is gone (a launcher killed with -9 cannot clean
    up after itself, and its dir may hold the run's secrets). Only dirs with our owner file."""
    removed = []
    for path in Path(parent or tempfile.gettempdir()).glob(PRIVATE_DIR_PREFIX + "*"):
        try:
            if path.stat().st_uid != os.geteuid():
                continue
            owner = (path / "owner").read_text()
        except OSError:
            continue
        if not _owner_alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


class ChannelMessage(dict):
    """A message an action plugin wrote to `runner_channel`, which `reply` answers on the same
    connection (one JSON line: the launch's word to a probed node, launch_node's `launch`)."""

    def __init__(self, message: dict[str, Any], conn: socket.socket) -> None:
        super().__init__(message)
        self._conn = conn

    def reply(self, answer: dict[str, Any]) -> bool:
        """Send `answer`; False when the plugin is gone (its worker ended or was killed)."""
        try:
            self._conn.sendall((json.dumps(answer) + "\n").encode())
        except OSError:
            return False
        return True


class _Channel:
    """A Unix socket in the private dir; each JSON line a client writes becomes a queue item."""

    def __init__(self, path: str, events: queue.Queue[dict[str, Any]]) -> None:
        # A socket's path must fit sun_path (108 bytes on Linux): under a long TMPDIR it goes into a
        # private dir of its own in /tmp instead, removed on close.
        self.own_dir: str | None = None
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            self.own_dir = tempfile.mkdtemp(prefix="ct-ch-", dir="/tmp")
            path = os.path.join(self.own_dir, "channel")
        self.path = path
        self.events = events
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        os.chmod(path, 0o600)
        self.server.listen(64)
        self.server.settimeout(0.2)
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._accept, name="runner-channel", daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as stream:
            for line in stream:
                try:
                    message = json.loads(line)
                except ValueError:
                    continue
                if isinstance(message, dict):
                    self.events.put({"event": "channel_message", "message": ChannelMessage(message, conn)})

    def close(self) -> None:
        self.closed.set()
        self.server.close()
        if self.own_dir is not None:
            shutil.rmtree(self.own_dir, ignore_errors=True)


def _task_result(event: dict[str, Any], status: str) -> TaskResult:
    data = event.get("event_data", {})
    return TaskResult(
        host=str(data.get("host", "")),
        task=str(data.get("task", "")),
        action=str(data.get("task_action", "")),
        status=status,
        result=dict(data.get("res") or {}),
        ignore_errors=bool(data.get("ignore_errors")),
    )


class _LiteralDumper(yaml.SafeDumper):
    """YAML for ansible-playbook's -e @file: every string that holds a template marker tagged !unsafe,
    so Ansible never renders a value given here (a command line with `{{ }}` reaches the node as
    written)."""


class _Template(str):
    """A string given to Ansible as a template (a late variable's lookup)."""


#: What starts a template (an expression, a statement, a comment) in Ansible's Jinja.
TEMPLATE_MARKERS = re.compile(r"\{\{|\{%|\{#")


def _represent_literal(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    # Only where Ansible would see a template: a string without one is never rendered, and
    # `!unsafe ''` would reach the play as None.
    if TEMPLATE_MARKERS.search(value):
        return dumper.represent_scalar("!unsafe", value)
    return dumper.represent_str(value)


_LiteralDumper.add_representer(str, _represent_literal)
_LiteralDumper.add_representer(_Template, lambda dumper, value: dumper.represent_str(str(value)))


def _write_private(path: str, text: str) -> None:
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as handle:
        handle.write(text)


@dataclass
class _Spawned:
    """One ansible-playbook process of ansible-runner's, from its start to its clean-up."""

    spec: _RunSpec
    thread: threading.Thread
    runner: Any
    events: queue.Queue[dict[str, Any]]
    private_data_dir: str
    channel: _Channel | None
    marker: str
    ssh_control_dir: str | None
    #: Any of these set cancels the run (the caller's `cancel` joins when the run is followed).
    cancels: list[threading.Event]

    def stop(self) -> None:
        """End ansible-playbook (it may wait for values it will never get) and wait for ansible-runner."""
        self.cancels[0].set()
        self.thread.join()

    def cancel(self) -> None:
        """End it and clean up."""
        self.stop()
        self.clean_up()

    def clean_up(self) -> None:
        _clean_up_run(self.channel, self.marker, self.private_data_dir, self.ssh_control_dir)


def _clean_up_run(
    channel: _Channel | None, marker: str, private_data_dir: str, ssh_control_dir: str | None = None
) -> None:
    if channel is not None:
        channel.close()
    # After a cancel (or a crash of ansible-runner) ansible-playbook may still be running; the SSH
    # masters it started would otherwise stay up for their ControlPersist.
    _end_processes(marker, ssh_control_dir=ssh_control_dir)
    shutil.rmtree(private_data_dir, ignore_errors=True)
    if ssh_control_dir:
        shutil.rmtree(ssh_control_dir, ignore_errors=True)


def _ssh_control_dir(private_data_dir: str) -> str:
    """A new dir for one run's SSH master sockets: in its private dir, or in /tmp where that path is
    too long for a socket or holds a `%` (ssh expands those). Resolved, as Ansible resolves it."""
    path = os.path.realpath(os.path.join(private_data_dir, "ssh"))
    if len(os.fsencode(path)) <= MAX_SSH_CONTROL_DIR and "%" not in path:
        os.mkdir(path, 0o700)
        return path
    return os.path.realpath(tempfile.mkdtemp(prefix="ct-ssh-", dir="/tmp"))


def _late_values_path(private_data_dir: str) -> str:
    """Where a prestarted run's values are written (its lookup finds the path in its environment)."""
    return os.path.join(private_data_dir, LATE_VALUES_FILE)


@dataclass(frozen=True)
class _RunSpec:
    """What is fixed when ansible-playbook starts: its command line and environment. A prestarted run
    is used only for a call that asks for the same."""

    playbook: Path
    inventory: Path
    limit: str | None
    tags: str | None
    skip_tags: str | None
    timeout_s: float | None
    verbosity: int
    env: tuple[tuple[str, str], ...]
    channel: bool

    @classmethod
    def of(
        cls,
        playbook: str | os.PathLike[str],
        inventory: str | os.PathLike[str],
        limit: str | None,
        tags: str | None,
        skip_tags: str | None,
        timeout_s: float | None,
        verbosity: int,
        env: Mapping[str, str] | None,
        channel: bool,
    ) -> _RunSpec:
        return cls(
            Path(playbook).resolve(),
            Path(inventory).resolve(),
            limit,
            tags,
            skip_tags,
            timeout_s,
            verbosity,
            tuple(sorted((env or {}).items())),
            channel,
        )


def _spawn(
    spec: _RunSpec,
    extravars: Mapping[str, Any],
    access: access_options.Access | None,
    late: Iterable[str] = (),
) -> _Spawned:
    """Start ansible-playbook through ansible-runner; its events go onto the returned run's queue."""
    import ansible_runner  # imported here: heavy, and only the controller's run paths need it
    import pexpect  # ansible-runner's own dependency: the prompts it answers

    access = access or access_options.current()
    cmdline = access.cmdline()  # checks the password files first (AccessError)
    # Before the run starts, so the one prompt comes before any output of the run.
    # A plain dict: ansible-runner reads patterns only from a mapping that is not an OrderedDict.
    answers: dict[Any, str | None] = {
        re.compile(pattern, re.M): answer for pattern, answer in access.expect_passwords().items()
    }
    answers.update({pexpect.TIMEOUT: None, pexpect.EOF: None})
    playbook = spec.playbook
    if not playbook.is_file():
        raise FileNotFoundError(f"playbook {playbook} does not exist")
    events: queue.Queue[dict[str, Any]] = queue.Queue()
    bin_dir = str(Path(sys.executable).parent)
    marker = f"{RUN_MARKER}={uuid.uuid4().hex}"
    cancels = [threading.Event()]

    def copy_event(event: dict[str, Any]) -> bool:
        events.put(event)
        return False  # ansible-runner writes no job_events file for it

    def filter_env(status_data: dict[str, Any], runner_config: Any = None) -> None:
        # "starting" comes before ansible-runner writes artifacts/<id>/command and spawns the process.
        if status_data.get("status") == "starting" and runner_config is not None:
            runner_config.env = {
                **PLAYBOOK_DEFAULTS,
                **filtered_environment(runner_config.env, bin_dir),
                SSH_CONTROL_DIR_ENV: ssh_control_dir,
                **dict(spec.env),
                RUN_MARKER: marker.split("=", 1)[1],
            }
            if not reads_config_file(runner_config.env, playbook.parent):
                config = Path(private_data_dir, "ansible.cfg")
                config.write_text(INTERNAL_POLL_CONFIG)
                runner_config.env["ANSIBLE_CONFIG"] = str(config)
            if late_names:
                runner_config.env[LATE_VALUES_ENV] = _late_values_path(private_data_dir)
            # In memory only: ansible-runner turns `passwords=` into this, after writing env/passwords.
            runner_config.expect_passwords = answers

    late_names = sorted(late)
    remove_stale_private_dirs()
    private_data_dir = tempfile.mkdtemp(prefix=PRIVATE_DIR_PREFIX)
    run_channel: _Channel | None = None
    ssh_control_dir: str | None = None
    try:
        Path(private_data_dir, "owner").write_text(_owner_text())
        ssh_control_dir = _ssh_control_dir(private_data_dir)
        given = dict(extravars)
        if spec.channel:
            run_channel = _Channel(os.path.join(private_data_dir, "channel"), events)
            given["runner_channel"] = run_channel.path
        vars_file = os.path.join(private_data_dir, "extravars.yml")
        # Through JSON first: plain types only (an inventory's host name may be a str subclass of Ansible's).
        values = json.loads(json.dumps(given))
        # The late variables are the one kind of template given: each reads its value when used.
        values.update(
            {name: _Template(LATE_TEMPLATE.format(lookup=LATE_VARS_LOOKUP, name=name)) for name in late_names}
        )
        text = yaml.dump(values, Dumper=_LiteralDumper, sort_keys=False)
        _write_private(vars_file, text)
        thread, runner = ansible_runner.run_async(
            private_data_dir=private_data_dir,
            project_dir=str(playbook.parent),
            playbook=str(playbook),
            inventory=str(spec.inventory),
            limit=spec.limit,
            tags=spec.tags,
            skip_tags=spec.skip_tags,
            verbosity=spec.verbosity or None,
            json_mode=True,
            quiet=True,
            event_handler=copy_event,
            status_handler=filter_env,
            cancel_callback=lambda: any(event.is_set() for event in cancels),
            timeout=spec.timeout_s,
            settings={"pexpect_timeout": CANCEL_POLL_S, "suppress_output_file": True},
            cmdline=shlex.join([*cmdline, "-e", f"@{vars_file}"]),
        )
    except BaseException:
        _clean_up_run(run_channel, marker, private_data_dir, ssh_control_dir)
        raise
    return _Spawned(
        spec, thread, runner, events, private_data_dir, run_channel, marker, ssh_control_dir, cancels
    )


class PrestartedRun:
    """ansible-playbook started before the values of its extra variables are known, so that its own
    start (about a second: Python, Ansible's imports, the inventory, the playbook) overlaps with the
    caller's work that computes them (`trainer launch`'s plan). Each late variable is given to Ansible
    as a lookup (`runner_late_vars`, in the playbook's lookup_plugins/) that waits for the values file
    written by `run_playbook(..., prestarted=...)`; nothing reaches a host before that, since every
    task's arguments name them. A lookup's value is never rendered as a template, as for the others.

    Hand it to run_playbook with the same playbook, inventory and options, and extra variables named
    exactly `late`: it is followed from there. Called otherwise, it is canceled and a new run started
    (the overlap is lost, nothing else). `cancel()` it when unused."""

    def __init__(self, spawned: _Spawned, late: frozenset[str]) -> None:
        self._spawned: _Spawned | None = spawned
        self.late = late

    def take(self, spec: _RunSpec, extravars: Mapping[str, Any]) -> _Spawned | None:
        """The run, with `extravars` handed over, if it was started as `spec` asks and still runs."""
        spawned, self._spawned = self._spawned, None
        if spawned is None:
            return None
        if spawned.spec != spec or set(extravars) != self.late or not spawned.thread.is_alive():
            spawned.cancel()
            return None
        values_file = _late_values_path(spawned.private_data_dir)
        partial = f"{values_file}.{os.getpid()}"
        _write_private(partial, json.dumps(dict(extravars)))
        os.replace(partial, values_file)  # whole, or not there: the lookup never reads half
        return spawned

    def cancel(self) -> None:
        spawned, self._spawned = self._spawned, None
        if spawned is not None:
            spawned.cancel()


def prestart_playbook(
    playbook: str | os.PathLike[str],
    inventory: str | os.PathLike[str],
    late: Iterable[str],
    *,
    limit: str | None = None,
    tags: str | None = None,
    skip_tags: str | None = None,
    timeout_s: float | None = None,
    verbosity: int = 0,
    env: Mapping[str, str] | None = None,
    access: access_options.Access | None = None,
    channel: bool = False,
) -> PrestartedRun:
    """Start `playbook` now, its extra variables `late` given later (PrestartedRun). `channel`: it will
    be followed with `on_message` (the channel's path is fixed at the start)."""
    spec = _RunSpec.of(playbook, inventory, limit, tags, skip_tags, timeout_s, verbosity, env, channel)
    lookup = spec.playbook.parent / "lookup_plugins" / f"{LATE_VARS_LOOKUP}.py"
    if not lookup.is_file():
        raise FileNotFoundError(f"{lookup} is missing: a prestarted playbook reads its variables with it")
    names = frozenset(late)
    if bad := sorted(name for name in names if not LATE_NAME.fullmatch(name)):
        raise ValueError(f"late variable names must be lower-case identifiers: {', '.join(bad)}")
    spawned = _spawn(spec, {}, access, late=names)
    return PrestartedRun(spawned, names)


def run_playbook(
    playbook: str | os.PathLike[str],
    inventory: str | os.PathLike[str],
    extravars: Mapping[str, Any] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    cancel: threading.Event | None = None,
    limit: str | None = None,
    tags: str | None = None,
    *,
    timeout_s: float | None = None,
    verbosity: int = 0,
    env: Mapping[str, str] | None = None,
    access: access_options.Access | None = None,
    on_message: Callable[[dict[str, Any]], None] | None = None,
    on_tick: Callable[[], None] | None = None,
    skip_tags: str | None = None,
    prestarted: PrestartedRun | None = None,
) -> PlaybookResult:
    """Run `playbook` against `inventory` and return what happened on each host.

    Blocks until the run ends; `on_event` is called on this thread for each event as it arrives.
    `env` adds variables (e.g. ANSIBLE_FORKS) on top of the filtered environment. `access` (default:
    what the command line configured, trainer.controller.access) gives the sudo and vault passwords.
    `on_message` receives what action plugins write to `runner_channel` (see the module's docstring);
    `on_tick` is called every TICK_S seconds, both on this thread. `extravars` are values, never
    templates. `prestarted`: a run prestart_playbook started for this call (used if it matches).
    KeyboardInterrupt cancels the run (ansible-playbook is terminated) and is then re-raised.
    """
    spec = _RunSpec.of(
        playbook, inventory, limit, tags, skip_tags, timeout_s, verbosity, env, on_message is not None
    )
    spawned = prestarted.take(spec, extravars or {}) if prestarted is not None else None
    if spawned is None:
        spawned = _spawn(spec, extravars or {}, access)
    if cancel is not None:
        spawned.cancels.append(cancel)
    try:
        return _follow(spawned, on_event, on_message, on_tick)
    finally:
        spawned.clean_up()


def _follow(
    spawned: _Spawned,
    on_event: Callable[[dict[str, Any]], None] | None,
    on_message: Callable[[dict[str, Any]], None] | None,
    on_tick: Callable[[], None] | None,
) -> PlaybookResult:
    """Hand the run's events to the callbacks until it ends; what it did."""
    results: list[TaskResult] = []
    stats: dict[str, Any] = {}
    seen: set[str] = set()
    seen_order: deque[str] = deque()
    output: deque[str] = deque()
    output_chars = 0

    def handle(event: dict[str, Any]) -> None:
        nonlocal output_chars
        name = event.get("event", "")
        if name == "channel_message":
            if on_message is not None:
                on_message(event["message"])
            return
        uuid = event.get("uuid")
        if uuid:
            if uuid in seen:
                return
            seen.add(uuid)
            seen_order.append(uuid)
            if len(seen_order) > SEEN_EVENTS:
                seen.discard(seen_order.popleft())
        if text := event.get("stdout"):
            output.append(text)
            output_chars += len(text) + 1
            while output_chars > OUTPUT_TAIL and len(output) > 1:
                output_chars -= len(output.popleft()) + 1
        if name in _RESULT_EVENTS:
            results.append(_task_result(event, _RESULT_EVENTS[name]))
        elif name == "playbook_on_stats":
            stats.update({k: v for k, v in event.get("event_data", {}).items() if isinstance(v, dict)})
        if on_event is not None:
            on_event(event)

    thread, events = spawned.thread, spawned.events
    next_tick = time.monotonic() + TICK_S
    try:
        while thread.is_alive() or not events.empty():
            with contextlib.suppress(queue.Empty):
                handle(events.get(timeout=0.1))
            if on_tick is not None and time.monotonic() >= next_tick:
                next_tick = time.monotonic() + TICK_S
                on_tick()
    except BaseException:
        spawned.stop()
        raise
    thread.join()
    runner = spawned.runner
    rc = runner.rc if isinstance(runner.rc, int) else 1
    return PlaybookResult(
        status=runner.status, rc=rc, results=results, stats=stats, output="\n".join(output)[-OUTPUT_TAIL:]
    )
