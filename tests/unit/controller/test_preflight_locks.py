"""The pieces of preflight that must never hang or lie, on real files, sockets and processes:
torch extension build locks (stale = no process holds it), the master-port listener after a job's
sockets linger in TIME_WAIT, the NFS server probe against a refusing and a silent server, the timed
shared-dir write against a write that blocks, trainer_env's ahead-of-time op build, and the
launcher refusing to start DeepSpeed on a stale lock."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jinja2
import pytest
import yaml

from trainer import torch_extensions

REPO = Path(__file__).resolve().parents[3]
FILES = REPO / "trainer" / "controller" / "preflight" / "playbooks" / "files"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, FILES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# A builder as torch's FileBaton is one: the lock created with O_EXCL and held open until the end.
HOLDER = """
import os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_lock_nobody_holds_is_stale_and_a_held_one_is_not(tmp_path):
    root = tmp_path / "extensions"
    held_dir, stale_dir = root / "op_building", root / "op_killed"
    held_dir.mkdir(parents=True)
    stale_dir.mkdir()
    (stale_dir / "lock").touch()
    builder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(held_dir / "lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert builder.stdout.readline().strip() == "held"
        found = torch_extensions.check(
            {"TORCH_EXTENSIONS_DIR": str(root), "XDG_CACHE_HOME": str(tmp_path / "none")}
        )
        by_op = {lock["op"]: lock for lock in found["locks"]}
        assert by_op["op_building"]["stale"] is False and by_op["op_building"]["holders"] == [builder.pid]
        assert by_op["op_killed"]["stale"] is True
        assert [lock["path"] for lock in found["stale"]] == [str(stale_dir / "lock")]
        fix = torch_extensions.stale_lock_fix(found["stale"][0], "ct-worker1", "trainer")
        assert f"on ct-worker1, as trainer: rm -rf {stale_dir}" in fix and "--tags trainer_env" in fix
    finally:
        builder.communicate("")
    # The builder is gone: its lock is stale now too.
    assert len(torch_extensions.check({"TORCH_EXTENSIONS_DIR": str(root)})["stale"]) == 2


def test_remove_stale_keeps_a_built_library_and_only_touches_locks_made_since(tmp_path):
    root = tmp_path / "extensions"
    built, half = root / "op_built", root / "op_half"
    built.mkdir(parents=True)
    half.mkdir()
    library = built / "op_built.so"
    library.write_bytes(b"\x7fELF")
    old = time.time() - 100
    os.utime(library, (old, old))
    (built / "lock").touch()  # a load of a built op was stopped: the library is whole
    (half / "half.o").write_bytes(b"partial")
    (half / "lock").touch()  # a compile was stopped: the half-built files go too
    environ = {"TORCH_EXTENSIONS_DIR": str(root), "XDG_CACHE_HOME": str(tmp_path / "none")}
    assert torch_extensions.remove_stale(environ, newer_than=time.time() + 60) == []  # none that new
    removed = torch_extensions.remove_stale(environ, newer_than=time.time() - 60)
    assert sorted(lock["op"] for lock in removed) == ["op_built", "op_half"]
    assert library.exists() and not (built / "lock").exists()
    assert not half.exists()


# What a process of the venv sees: the variable the .pth left, and (with "torch") the directory torch
# itself would build and load DeepSpeed's comm op in.
EXTENSIONS_PROBE = """
import json, os, sys
out = {"dir": os.environ.get("TORCH_EXTENSIONS_DIR")}
if sys.argv[1:] == ["torch"]:
    from torch.utils.cpp_extension import _get_build_directory
    out["build_dir"] = _get_build_directory("deepspeed_shm_comm", False)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def two_accounts():
    """The training account and another one, made on this machine for the test and removed after."""
    if os.geteuid() != 0 or not shutil.which("useradd"):
        pytest.skip("needs root and useradd to make two accounts")
    made = []
    for name in ("ct-ext-train", "ct-ext-other"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           check=True)  # fmt: skip
            made.append(name)
    yield pwd.getpwnam("ct-ext-train"), pwd.getpwnam("ct-ext-other")
    for name in made:
        subprocess.run(["userdel", name], check=False)


@pytest.fixture
def node_venv(two_accounts):
    """A venv as trainer_env leaves it: the trainer package in site-packages and the role's own .pth,
    rendered from its task. Made with a python every account may run (pytest's own is under /root),
    in a directory every account may enter (pytest's tmp_path is root's only)."""
    interpreter = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not interpreter.exists():
        pytest.skip(f"needs {interpreter}, which other accounts can run")
    base = Path(tempfile.mkdtemp(prefix="ct-ext-"))
    try:
        base.chmod(0o755)
        venv = base / "venv"
        subprocess.run([str(interpreter), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        (site / "trainer").symlink_to(REPO / "trainer")
        # torch from this checkout's venv, for torch's own answer of where it builds
        (site / "dev-venv.pth").write_text(f"{Path(torch_site())}\n")
        prebuilt = base / "var-cache" / "torch_extensions"  # trainer_env_torch_extensions_dir
        prebuilt.mkdir(parents=True)
        os.chown(prebuilt, two_accounts[0].pw_uid, two_accounts[0].pw_gid)  # the role's file task
        tasks = yaml.safe_load((REPO / "roles" / "trainer_env" / "tasks" / "deepspeed_ops.yml").read_text())
        (copy,) = [
            t["ansible.builtin.copy"] for t in tasks if str(t.get("ansible.builtin.copy")).count(".pth")
        ]
        template = jinja2.Environment(undefined=jinja2.StrictUndefined)
        template.filters["to_json"] = json.dumps
        pth = site / copy["dest"].rsplit("/", 1)[-1]
        pth.write_text(
            template.from_string(copy["content"]).render(trainer_env_torch_extensions_dir=str(prebuilt))
        )
        yield venv / "bin" / "python", prebuilt, base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def torch_site() -> str:
    """Where torch is installed, found without importing it (seconds) into the test process."""
    return str(Path(importlib.util.find_spec("torch").origin).parents[1])


def test_only_the_training_account_uses_its_prebuilt_ops_and_no_account_another_s(two_accounts, node_venv):
    """Root starting the venv's python (a DeepSpeed job run with sudo, a root cron job) loaded the
    libraries in the training account's dir, which that account can replace, and left root-owned
    builds there. The attacker's dirs are real dirs of another real account, with a library in them."""
    python, prebuilt, base = node_venv
    train, other = two_accounts
    planted = []
    for where in (base / "other" / "torch_extensions", base / "other-cache" / "torch_extensions"):
        library = where / "deepspeed_shm_comm" / "deepspeed_shm_comm.so"
        library.parent.mkdir(parents=True)
        library.write_bytes(b"\x7fELF planted")
        for path in (where.parent, where, library.parent, library):
            os.chown(path, other.pw_uid, other.pw_gid)
        planted.append(where)
    root_home = base / "root-home"
    root_home.mkdir(mode=0o700)

    def venv_python(env: dict, account=None, torch: bool = False) -> dict:
        ids = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []} if account else {}
        out = subprocess.run(
            [str(python), "-c", EXTENSIONS_PROBE, *(["torch"] if torch else [])],
            env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=300, cwd="/", **ids,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    # Root, as a root shell starts it, and with the training account's setting kept (sudo -E).
    as_root = venv_python({"HOME": str(root_home)}, torch=True)
    own = str(root_home / ".cache" / "torch_extensions")
    assert as_root == {"dir": own, "build_dir": f"{own}/deepspeed_shm_comm"}
    kept = venv_python({"HOME": str(root_home), "TORCH_EXTENSIONS_DIR": str(prebuilt)})
    assert kept["dir"] == own
    assert not any(prebuilt.iterdir()), "root built nothing in the training account's dir"
    # Root pointed at the other account's dirs, by the variable and by XDG_CACHE_HOME: neither is
    # used; root falls back to its home in the password database.
    aimed = venv_python(
        {
            "HOME": str(root_home),
            "TORCH_EXTENSIONS_DIR": str(planted[0]),
            "XDG_CACHE_HOME": str(planted[1].parent),
        }
    )
    assert aimed["dir"] == os.path.join(pwd.getpwuid(0).pw_dir, ".cache", "torch_extensions")

    # The training account still gets its prebuilt ops, torch included, and the other account's dir
    # set for it does not move it there.
    env = {"HOME": train.pw_dir}
    assert venv_python(env, train, torch=True) == {
        "dir": str(prebuilt),
        "build_dir": f"{prebuilt}/deepspeed_shm_comm",
    }
    assert venv_python({**env, "TORCH_EXTENSIONS_DIR": str(planted[0])}, train)["dir"] == str(prebuilt)
    # Its own choice of a dir of its own still wins (a job's training_env).
    mine = base / "train-scratch"
    mine.mkdir()
    os.chown(mine, train.pw_uid, train.pw_gid)
    assert venv_python({**env, "TORCH_EXTENSIONS_DIR": str(mine)}, train)["dir"] == str(mine)

    # The role's op build, run as the wrong account, refuses before it imports torch or builds.
    build = subprocess.run(
        [str(python), str(REPO / "roles" / "trainer_env" / "files" / "deepspeed_ops.py"), str(prebuilt)],
        env={"PATH": "/usr/bin:/bin", "HOME": str(root_home)},
        capture_output=True, text=True, timeout=120, cwd="/",
    )  # fmt: skip
    assert build.returncode != 0 and f"refusing to build in {prebuilt}" in build.stderr
    # Only the training account's own torch made anything there.
    assert {path.owner() for path in prebuilt.rglob("*")} == {train.pw_name}


def test_master_port_listener_binds_over_a_finished_jobs_time_wait_sockets():
    """Right after a job, its connections on the master port linger in TIME_WAIT: nothing listens,
    so preflight must not call the port busy (the rendezvous itself binds with SO_REUSEADDR)."""
    listener = load_script("head_listener")
    server = socket.socket()  # the job's rendezvous store, which listens with SO_REUSEADDR
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    port = server.getsockname()[1]
    server.listen(1)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the side that closes first keeps TIME_WAIT on the port
    time.sleep(0.2)
    client.close()
    server.close()
    plain = socket.socket()
    try:
        with pytest.raises(OSError) as busy:
            plain.bind(("127.0.0.1", port))
        assert busy.value.errno == errno.EADDRINUSE  # the TIME_WAIT is real
    finally:
        plain.close()
    sock = listener.bind("127.0.0.1", port)
    sock.close()


def test_nfs_probe_names_a_refusing_and_a_silent_server():
    facts = load_script("node_facts")
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    refused = facts.rpc_null("127.0.0.1", port=port, timeout=2)
    assert refused == {"answered": False, "error": "Connection refused"}
    silent = socket.socket()  # accepts (the kernel does) and never answers, as a hung server
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        hung = facts.rpc_null("127.0.0.1", port=silent.getsockname()[1], timeout=1)
    finally:
        silent.close()
    assert hung == {"answered": False, "error": "no answer within 1 s"}


def test_a_shared_dir_write_that_blocks_is_reported_hung_not_waited_for(tmp_path):
    """A FIFO nobody reads blocks the open for writing, as a hard NFS mount to a dead server does."""
    facts = load_script("node_facts")
    os.mkfifo(tmp_path / ".marker")
    started = time.monotonic()
    result = facts.timed_io(str(tmp_path), ".marker", "token", timeout=2)
    assert result["hung"] is True and result["error"] == "no answer within 2 s"
    assert time.monotonic() - started < 30
    live = facts.timed_io(str(tmp_path), ".other", "token", timeout=10)
    assert live["hung"] is False and live["error"] == "" and (tmp_path / ".other").read_text() == "token"
    assert live["free_bytes"] > 0


@pytest.mark.slow
def test_trainer_env_builds_deepspeed_ops_ahead_idempotently_and_clears_a_stale_lock(tmp_path):
    """roles/trainer_env/files/deepspeed_ops.py, as the role runs it: a real compile, then nothing."""
    script = REPO / "roles" / "trainer_env" / "files" / "deepspeed_ops.py"
    root = tmp_path / "torch_extensions"
    root.mkdir()

    def build() -> dict:
        out = subprocess.run(
            [sys.executable, str(script), str(root)],
            capture_output=True,
            text=True,
            timeout=1500,
            cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    first = build()
    assert first["changed"] is True and "deepspeed_shm_comm" in first["built"]
    manifest = json.loads((root / torch_extensions.MANIFEST).read_text())
    assert Path(manifest["ops"]["deepspeed_shm_comm"]).is_file()
    assert torch_extensions.check({"TORCH_EXTENSIONS_DIR": str(root)})["built"] == {
        "deepspeed_shm_comm": True
    }
    second = build()  # provisioning twice changes nothing, and needs no import of torch or DeepSpeed
    assert second["changed"] is False and second.get("up_to_date") is True, second
    assert second["built"] == manifest["ops"], "the libraries, for the converged check's record"
    library = Path(manifest["ops"]["deepspeed_shm_comm"])
    os.utime(library, (library.stat().st_atime, library.stat().st_mtime - 60))  # not what was built
    assert build().get("up_to_date") is None  # looked at by torch's own build check again
    (root / "deepspeed_shm_comm" / "lock").touch()  # a build killed by a stopped converge
    third = build()
    assert third["removed_stale"] == [str(root / "deepspeed_shm_comm" / "lock")] and third["changed"] is True
    assert not (root / "deepspeed_shm_comm" / "lock").exists()


@pytest.mark.slow
def test_launch_refuses_to_start_on_a_stale_build_lock_naming_file_and_fix(tmp_path):
    """The nodes' torch looks in the training user's ~/.cache/torch_extensions: here HOME is the test's
    own directory, so the lock is in no other test's way."""
    home = tmp_path / "home"
    lock = home / ".cache" / "torch_extensions" / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    shared = tmp_path / "shared"
    shared.mkdir()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "cluster": {
                    "children": {"head": {"hosts": {"node-a": {"cluster_ip": "127.0.0.1"}}}},
                    "vars": {
                        "ansible_connection": "local",
                        "ansible_python_interpreter": sys.executable,
                        "cluster_accelerators": 0,
                        "cluster_training_user": _user(),
                        "cluster_shared_dir": str(shared),
                        "cluster_master_port": port,
                        "training_procs_per_node": 1,
                        "training_venv": str(Path(sys.executable).parents[1]),
                    },
                }
            }
        )
    )
    env = {**os.environ, "HOME": str(home)}
    launch = [sys.executable, "-m", "trainer", "launch", "-i", str(inventory), "--run-name", "locked"]
    try:
        out = subprocess.run(
            [*launch, "--engine", "deepspeed", "--set", "train.max_steps=2"],
            capture_output=True, text=True, env=env, timeout=300, cwd=REPO,
        )  # fmt: skip
    finally:  # a start that went ahead would hang on the lock: never leave it running
        subprocess.run([*launch, "--stop"], capture_output=True, env=env, timeout=300, cwd=REPO)
    text = out.stdout + out.stderr
    assert out.returncode != 0, text
    assert f"stale build lock {lock}" in text and f"rm -rf {lock.parent}" in text
    assert not (shared / "runs" / "locked" / "launch" / "node-0" / "pid").exists()  # nothing started


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name
