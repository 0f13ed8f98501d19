#!/usr/bin/python
"""Read what site.yml manages on a node, in one round trip, and compare it with the last full run.

A full `site.yml` run ends by recording, on every node, what its roles manage there (the "watch
spec" the roles name: files, directory listings, services, packages, accounts, mounts, ufw's rule
set) and the state each item was left in. The next run's first step on each node (`mode: probe`)
reads the same items again and compares: when every node still holds the state of the same full
run, made from the same inputs (roles, trainer sources, wheelhouse, inventory), the roles have
nothing to do and site.yml skips them (roles/converged/README.md).

Modes:
  probe   read-only (runs in check mode): the record, the items it names, now; what differs.
  digest  read-only: the state of the items of `spec` now, and its digest.
  record  write the record (root-only file): `spec`, the `state` the digest step just read (not
          read a second time), `inputs` and `cluster_digest`; unchanged, and reported so, when the
          record already holds the same.

Root reads paths an unprivileged user controls (the training user's ~/.ssh): every path is walked
from / one component at a time with O_NOFOLLOW, so a symlink planted anywhere in it is recorded as
such and never followed; only regular files are opened (O_NONBLOCK: a FIFO cannot hang the read).
The item kinds are fixed here: the record names paths and units, never a command to run.

An item root cannot read (a home on NFS that squashes root, a systemd that does not answer) is never
called converged: the probe cannot tell whether it changed, so it asks for a full run, in one line
that names the item.

A read that does not return at all (a home on an NFS server that stopped answering: the stat blocks
in the kernel) is a different failure: the roles would block on the same path. A watchdog thread
ends the module after `hang_timeout_s` on one read, naming the node and the path it waits on, so
site.yml stops with that message instead of hanging (the task's own `timeout` in tasks/probe.yml is
the backstop for a module that cannot even report).
"""

from __future__ import annotations

import errno
import grp
import hashlib
import json
import os
import pwd
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: converged_state
short_description: Read, compare and record the state site.yml's roles manage on a node
options:
  mode:
    description: probe (compare with the record), digest (read only), record (write the record).
    type: str
    choices: [probe, digest, record]
    required: true
  path:
    description: The record file (root-only).
    type: path
    default: /var/lib/clustertrain/converged.json
  spec:
    description: >-
      What to read (digest, record) - paths, listings, services, packages, users, groups, mounts
      (lists of names), ufw and sshd (bool: the ports `sshd -T` reports, which ssh_trust derives).
    type: dict
  state:
    description: The state the digest step returned for the same spec (record).
    type: dict
  inputs:
    description: The controller's digest of the run's inputs (probe, record).
    type: str
  cluster_digest:
    description: The digest of every node's state and the inputs, the same on every node (record).
    type: str
  hang_timeout_s:
    description: >-
      Seconds one read may block (probe, digest): past it the module fails at once, naming C(node) and
      the path (or item) it waits on. 0 turns the watchdog off.
    type: float
    default: 60
  node:
    description: The node's name in the inventory, for the hang message.
    type: str
    default: ""
  read_budget_s:
    description: >-
      Seconds the read of the items may take (probe, digest); the items left after it are unknown,
      which makes the run a full one. Files larger than 16 MiB are not hashed (unreadable: a full run).
    type: float
    default: 60
"""

RETURN = r"""
converged:
  description: probe - the record exists, was made from these inputs, and every item it names is as recorded.
  type: bool
reasons:
  description: probe - why not, one line each (at most 20).
  type: list
host_digest:
  description: The digest of this node's items now (probe, digest, record).
  type: str
state:
  description: digest - each item's state, for the record step.
  type: dict
cluster_digest:
  description: probe - the cluster digest the record holds.
  type: str
items:
  description: How many items were read.
  type: int
hung:
  description: >-
    The item a read blocked on past hang_timeout_s (the module then fails), e.g. "path /home/trainer/.ssh".
  type: str
"""

RECORD_VERSION = 1
SPEC_KINDS = ("paths", "listings", "services", "packages", "users", "groups", "mounts")
#: Kinds that are on or off: ufw's rule set, and the ports sshd listens on.
FLAG_KINDS = ("ufw", "sshd")
#: How a state read starts when root could not read the item: its state now is unknown.
UNSEEN = ("unreadable", "unknown (")
MAX_REASONS = 20
COMMAND_TIMEOUT_S = 20
#: The largest file the probe hashes. The files the roles manage are a few KiB; a larger one (a huge
#: file the training user put in ~/.ssh) would hold up every run's probe, so it is reported unreadable
#: (a full run) instead of read.
MAX_HASHED_BYTES = 16 << 20
#: The whole read's time budget: past it, the items left are unknown (a full run), so a slow disk or
#: a stalled NFS home cannot stall the run's first step.
READ_BUDGET_S = 60.0
#: The longest one read may block before the module gives up on the node (a hung mount).
HANG_TIMEOUT_S = 60.0


# --- a read that never returns --------------------------------------------------------------------


class Watchdog:
    """Ends the module when one read blocks for longer than `limit_s`, naming the node and the item.

    A stat or open on a mount whose server stopped answering waits in the kernel, where no Python
    timeout reaches it; a second thread can still answer for the module and end the process
    (os._exit: the blocked thread's wait is killable, so the process does exit)."""

    def __init__(self, limit_s: float, node: str) -> None:
        self.limit_s = limit_s
        self.node = node or os.uname().nodename
        self._lock = threading.Lock()
        self._item = ""
        self._since = 0.0
        if limit_s > 0:
            threading.Thread(target=self._watch, name="converged-watchdog", daemon=True).start()

    def reading(self, item: str) -> Watchdog:
        with self._lock:
            self._item, self._since = item, time.monotonic()
        return self

    def __enter__(self) -> Watchdog:
        return self

    def __exit__(self, *_exc: object) -> None:
        with self._lock:
            self._item = ""

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.limit_s / 10))
            with self._lock:
                item, since = self._item, self._since
            if item and time.monotonic() - since > self.limit_s:
                self._give_up(item)

    def _give_up(self, item: str) -> None:
        message = (
            f"{self.node}: the converged probe waited {self.limit_s:.0f} s on {item} and it did not answer"
            " (a hung NFS home or mount?): every role would hang on it too, so the run stops here."
            " Fix the mount (or the server behind it) on this node, then run site.yml again."
        )
        sys.stdout.write(json.dumps({"failed": True, "changed": False, "msg": message, "hung": item}) + "\n")
        sys.stdout.flush()
        os._exit(1)


#: No watchdog: a call from a test or another module's import.
NO_WATCHDOG = Watchdog(0, "")


# --- paths, read without following a link --------------------------------------------------------


class LinkInPath(Exception):
    """A component of the path (not the last one) is a symbolic link or not a directory."""


def open_parent(path: str) -> tuple[int, str]:
    """A directory fd for the path's parent, walked from / with O_NOFOLLOW, and the last component."""
    if not path.startswith("/"):
        raise ValueError(f"not an absolute path: {path}")
    parts = [part for part in path.split("/") if part]
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for index, part in enumerate(parts[:-1]):
            try:
                next_fd = os.open(
                    part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except FileNotFoundError:
                raise
            except OSError as err:
                if err.errno in (errno.ENOTDIR, errno.ELOOP):  # a link, or a file where a dir should be
                    raise LinkInPath("/" + "/".join(parts[: index + 1])) from err
                raise
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1] if parts else "."


def read_at(path: str, read: Callable[[int, str], str]) -> str:
    """read(parent_fd, name) for a path walked without links; "absent" when it is not there."""
    try:
        parent, name = open_parent(path)
    except FileNotFoundError:
        return "absent"
    except LinkInPath as err:
        return f"not a directory or a link in the path: {err}"
    except OSError as err:
        return f"unreadable: {err.strerror}"
    try:
        return read(parent, name)
    except FileNotFoundError:
        return "absent"
    except OSError as err:  # a file or directory in it root may not open (a home that squashes root)
        return f"unreadable: {err.strerror}"
    finally:
        os.close(parent)


def entry_state(parent: int, name: str) -> str:
    st = os.lstat(name, dir_fd=parent)
    owner = f"{stat.S_IMODE(st.st_mode):04o} {st.st_uid}:{st.st_gid}"
    if stat.S_ISLNK(st.st_mode):
        return f"link {owner} -> {os.readlink(name, dir_fd=parent)}"
    if stat.S_ISDIR(st.st_mode):
        return f"dir {owner}"
    if not stat.S_ISREG(st.st_mode):
        kinds = {stat.S_IFIFO: "fifo", stat.S_IFSOCK: "socket", stat.S_IFCHR: "char", stat.S_IFBLK: "block"}
        return f"{kinds.get(stat.S_IFMT(st.st_mode), 'special')} {owner}"
    if st.st_size > MAX_HASHED_BYTES:
        return f"unreadable: {st.st_size} bytes, more than the {MAX_HASHED_BYTES} the probe hashes"
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
    with os.fdopen(fd, "rb") as handle:
        digest = hashlib.sha256()
        read = 0
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            read += len(chunk)
            if read > MAX_HASHED_BYTES:  # it grew while being read
                return f"unreadable: grew past the {MAX_HASHED_BYTES} bytes the probe hashes"
            digest.update(chunk)
    return f"file {owner} sha256:{digest.hexdigest()}"


def listing(parent: int, name: str) -> str:
    """The sorted names in a directory (pip's dist-info dirs show which packages a venv holds)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    except OSError as err:
        if err.errno in (errno.ENOTDIR, errno.ELOOP):
            return f"not a directory: {err.strerror}"
        raise  # absent or unreadable: read_at says which
    try:
        # __pycache__ comes and goes with whoever imports a top-level module: not a change.
        names = sorted(entry for entry in os.listdir(fd) if entry != "__pycache__")
    finally:
        os.close(fd)
    return "names sha256:" + hashlib.sha256("\n".join(names).encode()).hexdigest() + f" ({len(names)})"


def path_state(path: str) -> str:
    return read_at(path, entry_state)


def listing_state(path: str) -> str:
    return read_at(path, listing)


# --- system state ---------------------------------------------------------------------------------


def run(argv: list[str]) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except FileNotFoundError:
        return 127, ""
    except subprocess.TimeoutExpired:
        return 124, ""
    return done.returncode, done.stdout


def services_state(units: list[str]) -> dict[str, str]:
    """Whether each unit runs and starts at boot (systemctl show, one call for all)."""
    if not units:
        return {}
    rc, out = run(["systemctl", "show", "--property=Id,LoadState,ActiveState,UnitFileState", "--", *units])
    blocks = [block for block in out.split("\n\n") if block.strip()] if rc == 0 else []
    states = {}
    for index, unit in enumerate(units):
        if index >= len(blocks):
            states[unit] = f"unknown (systemctl show exit {rc})"
            continue
        props = dict(line.split("=", 1) for line in blocks[index].splitlines() if "=" in line)
        states[unit] = "{LoadState} {ActiveState} {UnitFileState}".format(
            **{key: props.get(key, "?") for key in ("LoadState", "ActiveState", "UnitFileState")}
        )
    return states


def packages_state(names: list[str]) -> dict[str, str]:
    """dpkg's status of each package (`install ok installed` when it is there)."""
    if not names:
        return {}
    _, out = run(["dpkg-query", "-W", "-f=${Package}\t${Status}\n", "--", *names])
    found = dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    return {name: found.get(name, "not installed") for name in names}


def user_state(name: str) -> str:
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        return "absent"
    return f"uid {entry.pw_uid} gid {entry.pw_gid} home {entry.pw_dir} shell {entry.pw_shell}"


def group_state(name: str) -> str:
    try:
        return f"gid {grp.getgrnam(name).gr_gid}"
    except KeyError:
        return "absent"


def mounts_state(points: list[str]) -> dict[str, str]:
    """What is mounted on each mount point (source and file system type), from mountinfo."""
    mounted: dict[str, str] = {}
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as handle:
            for line in handle:
                left, _, right = line.partition(" - ")
                fields, tail = left.split(), right.split()
                if len(fields) >= 5 and len(tail) >= 2:
                    point = fields[4].replace("\\040", " ")
                    mounted[point] = f"{tail[1]} {tail[0]}"  # the last mount on a point is the one seen
    except OSError as err:
        return {point: f"unreadable: {err.strerror}" for point in points}
    return {point: mounted.get(point.rstrip("/") or "/", "not mounted") for point in points}


def ufw_state() -> str:
    rc, out = run(["ufw", "status", "verbose"])
    return f"exit {rc} sha256:{hashlib.sha256(out.encode()).hexdigest()}"


def kernel_firewall_state() -> str:
    """The filter rules the kernel holds now (iptables-save and ip6tables-save read them through
    whichever backend, legacy or nft), counters left out. ufw's status is read from its files and a
    running chain's presence, so rules flushed with iptables or nft behind ufw's back only show here."""
    parts = []
    for command in ("iptables-save", "ip6tables-save"):
        rc, out = run([command, "-t", "filter"])
        rules = [
            line.split(" [", 1)[0] if line.startswith(":") else line
            for line in out.splitlines()
            if line and not line.startswith("#")
        ]
        parts.append(f"{command} exit {rc}: {len(rules)} lines")
        parts.append("\n".join(rules))
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return f"{parts[0]}, {parts[2]} sha256:{digest}"


def sshd_ports() -> str:
    """The ports sshd listens on, in the order `sshd -T` gives them: ssh_trust reads the same command
    to pick the port the other nodes dial (22 when it is one, else the first), so a port changed in
    sshd's config changes what ssh_trust writes on every node."""
    rc, out = run(["/usr/sbin/sshd", "-T"])
    if rc != 0:
        return f"sshd -T exit {rc}"
    return " ".join(line.split()[1] for line in out.splitlines() if line.startswith("port "))


def os_release() -> str:
    return path_state("/etc/os-release")


def read_state(
    spec: dict, budget_s: float = READ_BUDGET_S, watchdog: Watchdog = NO_WATCHDOG
) -> dict[str, str]:
    """Every item the spec names -> its state now, as one flat, comparable map. Items left when the
    time budget runs out are "unknown (...)": the probe then asks for a full run. A read that blocks
    past the watchdog's limit ends the module (Watchdog)."""
    deadline = time.monotonic() + budget_s
    with watchdog.reading("path /etc/os-release"):
        state = {"os-release": os_release()}
    reads: list[tuple[str, Callable[[], object]]] = [
        *((f"path {path}", lambda path=path: path_state(path)) for path in spec.get("paths") or []),
        *((f"listing {path}", lambda path=path: listing_state(path)) for path in spec.get("listings") or []),
        ("services", lambda: services_state(list(spec.get("services") or []))),
        ("packages", lambda: packages_state(list(spec.get("packages") or []))),
        *((f"user {name}", lambda name=name: user_state(name)) for name in spec.get("users") or []),
        *((f"group {name}", lambda name=name: group_state(name)) for name in spec.get("groups") or []),
        ("mounts", lambda: mounts_state(list(spec.get("mounts") or []))),
    ]
    if spec.get("ufw"):
        reads.append(("ufw status", ufw_state))
        reads.append(("kernel firewall", kernel_firewall_state))
    if spec.get("sshd"):
        reads.append(("sshd ports", sshd_ports))
    for key, read in reads:
        if time.monotonic() > deadline:
            state[key] = f"unknown (the probe's {budget_s:.0f} s budget ran out before it)"
            continue
        with watchdog.reading(key):
            value = read()
        if isinstance(value, dict):  # one call for many items: services, packages, mounts
            prefix = {"services": "service", "packages": "package", "mounts": "mount"}[key]
            state.update({f"{prefix} {name}": item for name, item in value.items()})
        else:
            state[key] = str(value)
    return state


def digest_of(state: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def normal_spec(spec: dict | None) -> dict:
    """The spec with each list sorted and deduplicated: roles name some items twice."""
    spec = spec or {}
    unknown = sorted(set(spec) - set(SPEC_KINDS) - set(FLAG_KINDS))
    if unknown:
        raise ValueError(
            f"unknown kinds in the watch spec: {', '.join(unknown)}"
            f" (known: {', '.join(SPEC_KINDS + FLAG_KINDS)})"
        )
    normal: dict = {kind: sorted({str(item) for item in spec.get(kind) or []}) for kind in SPEC_KINDS}
    normal.update({kind: bool(spec.get(kind)) for kind in FLAG_KINDS})
    return normal


# --- the record -----------------------------------------------------------------------------------


def load_record(path: str) -> tuple[dict | None, str]:
    directory = path_state(os.path.dirname(path))
    if directory == "absent":
        return None, "no record of a full run on this node"
    if not directory.startswith("dir 0700 0:"):
        return (
            None,
            f"{os.path.dirname(path)} is not a root-only directory ({directory}); the record is not read",
        )
    try:
        parent, name = open_parent(path)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        finally:
            os.close(parent)
        with os.fdopen(fd, encoding="utf-8") as handle:
            if os.fstat(handle.fileno()).st_uid != 0:
                return None, f"{path} is not root's; ignored"
            record = json.load(handle)
    except FileNotFoundError:
        return None, "no record of a full run on this node"
    except (OSError, ValueError, LinkInPath) as err:
        return None, f"record unreadable ({err}); a full run writes it again"
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
        return None, "record from another version of this check; a full run writes it again"
    return record, ""


def write_record(path: str, record: dict) -> None:
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0:
        raise OSError(f"{directory} is not a directory owned by root")
    os.chmod(directory, 0o700)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".converged.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(record, handle, indent=1, sort_keys=True)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def probe(params: dict, watchdog: Watchdog = NO_WATCHDOG) -> dict:
    with watchdog.reading(f"the record {params['path']}"):
        record, why = load_record(params["path"])
    if record is None:
        return {"converged": False, "reasons": [why], "host_digest": "", "cluster_digest": "", "items": 0}
    state = read_state(record.get("spec") or {}, params.get("read_budget_s", READ_BUDGET_S), watchdog)
    reasons = []
    if record.get("inputs") != params["inputs"]:
        reasons.append(
            "the inputs changed since the last full run (roles, trainer sources, wheelhouse or inventory)"
        )
    recorded = record.get("state") or {}
    # What root cannot read now may have changed in any way (an authorized_keys deleted on a home
    # that squashes root reads "unreadable" before and after): never converged, said in one line.
    unseen = sorted(key for key, value in state.items() if value.startswith(UNSEEN))
    if unseen:
        more = f" and {len(unseen) - 1} more item{'s' if len(unseen) > 2 else ''}" if len(unseen) > 1 else ""
        reasons.append(
            f"root cannot read {unseen[0]} ({state[unseen[0]]}){more} here, so it cannot tell what"
            " changed: every role runs while it cannot (a home on NFS that squashes root does this)"
        )
    for key in sorted(set(state) | set(recorded)):
        if key in unseen:
            continue
        if state.get(key) != recorded.get(key):
            before, now = recorded.get(key, "not recorded"), state.get(key, "not read")
            reasons.append(f"{key}: {shorten(before)} -> {shorten(now)}")
    return {
        "converged": not reasons,
        "reasons": reasons[:MAX_REASONS]
        + ([f"... and {len(reasons) - MAX_REASONS} more"] if len(reasons) > MAX_REASONS else []),
        "host_digest": digest_of(state),
        "cluster_digest": record.get("cluster_digest", ""),
        "recorded_at": record.get("recorded_at", ""),
        "items": len(state),
    }


def shorten(value: str) -> str:
    return value if len(value) <= 60 else value[:44] + "..." + value[-13:]


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "mode": {"type": "str", "choices": ["probe", "digest", "record"], "required": True},
            "path": {"type": "path", "default": "/var/lib/clustertrain/converged.json"},
            "spec": {"type": "dict"},
            "inputs": {"type": "str"},
            "cluster_digest": {"type": "str"},
            "state": {"type": "dict"},
            "read_budget_s": {"type": "float", "default": READ_BUDGET_S},
            "hang_timeout_s": {"type": "float", "default": HANG_TIMEOUT_S},
            "node": {"type": "str", "default": ""},
        },
        required_if=[
            ("mode", "probe", ["inputs"]),
            ("mode", "digest", ["spec"]),
            ("mode", "record", ["spec", "state", "inputs", "cluster_digest"]),
        ],
        supports_check_mode=True,
    )
    params = module.params
    watchdog = Watchdog(params["hang_timeout_s"], params["node"])
    if params["mode"] == "probe":
        module.exit_json(changed=False, **probe(params, watchdog))
    try:
        spec = normal_spec(params["spec"])
    except ValueError as err:
        module.fail_json(msg=str(err))
    if params["mode"] == "digest":
        state = read_state(spec, params["read_budget_s"], watchdog)
        module.exit_json(changed=False, state=state, host_digest=digest_of(state), items=len(state))
    # The state the digest step read a moment ago: the cluster digest was made from it.
    state = {str(key): str(value) for key, value in params["state"].items()}
    result = {"host_digest": digest_of(state), "items": len(state)}
    record, _ = load_record(params["path"])
    wanted = {
        "version": RECORD_VERSION,
        "spec": spec,
        "inputs": params["inputs"],
        "cluster_digest": params["cluster_digest"],
        "state": state,
    }
    if record is not None and {key: record.get(key) for key in wanted} == wanted:
        module.exit_json(changed=False, **result)
    if not module.check_mode:
        wanted["recorded_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            write_record(params["path"], wanted)
        except OSError as err:
            module.fail_json(msg=f"cannot write {params['path']}: {err}", **result)
    module.exit_json(changed=True, **result)


if __name__ == "__main__":
    main()
