"""The converged check's node side (roles/converged/library/converged_state.py), run as Ansible runs it.

Each test runs the module as a separate process with its arguments file, on files in a temp dir:
record, then probe, then change one thing a role manages and probe again. What a user notices:
an untouched node is reported converged (site.yml skips its roles), and any change to a watched
item names that item and makes the run a full one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.hung_mount import hung_mount

MODULE = Path(__file__).resolve().parents[3] / "roles" / "converged" / "library" / "converged_state.py"
#: Root as on a home on NFS that squashes root: without the capabilities that let it read any file.
SQUASHED_ROOT = [
    "setpriv",
    "--inh-caps=-dac_override,-dac_read_search",
    "--bounding-set=-dac_override,-dac_read_search",
]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the record is root's own (its dir is checked for uid 0)"
)


def module(tmp_path: Path, runner: tuple[str, ...] = (), **args) -> dict:
    args_file = tmp_path / "args.json"
    args_file.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    done = subprocess.run(
        [*runner, sys.executable, str(MODULE), str(args_file)], capture_output=True, text=True, timeout=60
    )
    return json.loads(done.stdout)


@pytest.fixture()
def node(tmp_path: Path) -> dict:
    """A few managed files and a record path, as a role would name them."""
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "chrony.conf").write_text("server head iburst\n")
    (etc / "exports").write_text("/srv/shared 10.0.0.0/24(rw)\n")
    venv = tmp_path / "site-packages"
    venv.mkdir()
    (venv / "torch-2.13.0.dist-info").mkdir()
    spec = {
        "paths": [str(etc / "chrony.conf"), str(etc / "exports"), str(etc / "absent.conf")],
        "listings": [str(venv)],
        "users": ["root"],
        "groups": ["root"],
        "mounts": ["/"],
    }
    return {
        "tmp": tmp_path,
        "etc": etc,
        "venv": venv,
        "spec": spec,
        "record": str(tmp_path / "state" / "converged.json"),
    }


def record(node: dict, inputs: str = "inputs-1", cluster: str = "cluster-1", runner: tuple = ()) -> dict:
    """The record play's two steps: read the state, then write what was read."""
    read = module(node["tmp"], runner, mode="digest", spec=node["spec"])
    if read.get("failed"):
        return read
    written = module(
        node["tmp"],
        runner,
        mode="record",
        path=node["record"],
        spec=node["spec"],
        state=read["state"],
        inputs=inputs,
        cluster_digest=cluster,
    )
    assert written["host_digest"] == read["host_digest"]
    return written


def probe(node: dict, inputs: str = "inputs-1", runner: tuple = ()) -> dict:
    return module(node["tmp"], runner, mode="probe", path=node["record"], inputs=inputs)


def test_untouched_node_is_converged_and_its_digest_matches_the_record(node):
    written = record(node)
    assert written["changed"] is True
    assert oct(os.stat(Path(node["record"]).parent).st_mode & 0o777) == "0o700"
    assert oct(os.stat(node["record"]).st_mode & 0o777) == "0o600"
    seen = probe(node)
    assert seen["converged"] is True, seen["reasons"]
    assert seen["cluster_digest"] == "cluster-1"
    assert seen["host_digest"] == written["host_digest"]
    # 3 paths, 1 listing, 1 user, 1 group, 1 mount and the OS release
    assert seen["items"] == 8


def test_a_second_full_run_leaves_the_record_unchanged(node):
    record(node)
    before = Path(node["record"]).read_text()
    again = record(node)
    assert again["changed"] is False
    assert Path(node["record"]).read_text() == before


def test_a_changed_file_is_named_and_the_node_is_not_converged(node):
    record(node)
    (node["etc"] / "chrony.conf").write_text("server pool.invalid iburst\n")
    seen = probe(node)
    assert seen["converged"] is False
    assert len(seen["reasons"]) == 1
    assert seen["reasons"][0].startswith(f"path {node['etc'] / 'chrony.conf'}: file 0644 0:0 sha256:")


def test_mode_owner_and_appearing_files_count_as_changes(node):
    record(node)
    os.chmod(node["etc"] / "exports", 0o666)
    (node["etc"] / "absent.conf").write_text("x\n")
    reasons = probe(node)["reasons"]
    assert [reason.split(":")[0] for reason in reasons] == [
        f"path {node['etc'] / 'absent.conf'}",
        f"path {node['etc'] / 'exports'}",
    ]
    assert "absent -> file 0644" in reasons[0]
    assert "file 0644" in reasons[1] and "-> file 0666" in reasons[1]


def test_a_package_installed_into_the_venv_is_seen_through_the_listing(node):
    record(node)
    (node["venv"] / "evil-1.0.dist-info").mkdir()
    (node["venv"] / "__pycache__").mkdir()  # comes and goes with imports: not a change by itself
    reasons = probe(node)["reasons"]
    assert len(reasons) == 1 and reasons[0].startswith(f"listing {node['venv']}: names sha256:")
    assert reasons[0].endswith("(2)")


def test_other_inputs_make_a_full_run(node):
    record(node)
    seen = probe(node, inputs="inputs-2")
    assert seen["converged"] is False
    assert seen["reasons"] == [
        "the inputs changed since the last full run (roles, trainer sources, wheelhouse or inventory)"
    ]


def test_no_record_means_a_full_run(node):
    seen = probe(node)
    assert seen == {**seen, "converged": False, "reasons": ["no record of a full run on this node"]}


def test_a_record_dir_others_can_write_is_not_read(node):
    record(node)
    os.chmod(Path(node["record"]).parent, 0o777)
    seen = probe(node)
    assert seen["converged"] is False
    assert "is not a root-only directory (dir 0777 0:0)" in seen["reasons"][0]


def test_a_symlink_in_a_watched_path_is_recorded_never_followed(node):
    """Root reads the training user's ~/.ssh: a link planted there must not make it read elsewhere."""
    home = node["tmp"] / "home"
    home.mkdir()
    secret_dir = node["tmp"] / "secret"
    secret_dir.mkdir()
    (secret_dir / "authorized_keys").write_text("root's secret\n")
    (home / ".ssh").symlink_to(secret_dir)
    node["spec"]["paths"].append(str(home / ".ssh" / "authorized_keys"))
    node["spec"]["paths"].append(str(home / ".ssh"))
    record(node)
    state = json.loads(Path(node["record"]).read_text())["state"]
    assert (
        state[f"path {home / '.ssh' / 'authorized_keys'}"]
        == f"not a directory or a link in the path: {home / '.ssh'}"
    )
    assert state[f"path {home / '.ssh'}"] == f"link 0777 0:0 -> {secret_dir}"
    (secret_dir / "authorized_keys").write_text("changed behind the link\n")
    assert probe(node)["converged"] is True  # the target was never read, so its change is not seen


def test_what_root_cannot_read_is_never_converged_and_said_once(node):
    """A training home on NFS that squashes root: root (here, without its DAC capabilities) cannot
    enter ~/.ssh, so a deleted authorized_keys reads "unreadable" before and after. The node is never
    called converged, in one reason that names the item, and a file root may see but not open is
    unreadable too (it made the module fail before)."""
    home = node["tmp"] / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "authorized_keys").write_text("ssh-ed25519 AAAA cluster\n")
    (home / "notes").write_text("the user's own\n")
    for path, mode in (
        (home / ".ssh", 0o700),
        (home / ".ssh" / "authorized_keys", 0o600),
        (home / "notes", 0o600),
    ):
        os.chown(path, 65534, 65534)
        os.chmod(path, mode)
    node["spec"]["paths"] += [str(home / ".ssh"), str(home / ".ssh" / "authorized_keys"), str(home / "notes")]
    assert record(node, runner=SQUASHED_ROOT)["changed"] is True
    state = json.loads(Path(node["record"]).read_text())["state"]
    assert state[f"path {home / '.ssh' / 'authorized_keys'}"] == "unreadable: Permission denied"
    assert state[f"path {home / 'notes'}"] == "unreadable: Permission denied"

    (home / ".ssh" / "authorized_keys").unlink()
    seen = probe(node, runner=SQUASHED_ROOT)
    assert seen["converged"] is False
    assert seen["reasons"] == [
        f"root cannot read path {home / '.ssh' / 'authorized_keys'} (unreadable: Permission denied)"
        " and 1 more item here,"
        " so it cannot tell what changed: every role runs while it cannot"
        " (a home on NFS that squashes root does this)"
    ]
    assert probe(node)["converged"] is False, "root that can read sees the deleted file itself"


def test_a_fifo_is_recorded_without_blocking(node):
    fifo = node["etc"] / "fifo"
    os.mkfifo(fifo)
    node["spec"]["paths"].append(str(fifo))
    record(node)
    assert json.loads(Path(node["record"]).read_text())["state"][f"path {fifo}"] == "fifo 0644 0:0"


def test_a_removed_account_is_seen(node, tmp_path):
    node["spec"]["users"] = ["root", "clustertrain-no-such-user"]
    record(node)
    state = json.loads(Path(node["record"]).read_text())["state"]
    assert state["user root"].startswith("uid 0 gid 0 home /root")
    assert state["user clustertrain-no-such-user"] == "absent"
    assert state["mount /"] != "not mounted"


def test_an_unknown_kind_in_the_spec_is_refused(node):
    node["spec"]["commands"] = ["rm -rf /"]
    failed = record(node)
    assert failed["failed"] is True
    assert "unknown kinds in the watch spec: commands" in failed["msg"]
    assert not Path(node["record"]).exists()


def test_probe_changes_nothing_in_check_mode(node):
    seen = module(node["tmp"], mode="probe", path=node["record"], inputs="x", _ansible_check_mode=True)
    assert seen["converged"] is False
    assert not Path(node["record"]).parent.exists()


def test_a_huge_file_is_not_hashed_and_makes_a_full_run(node):
    """A file far larger than any a role writes (the training user can put one in ~/.ssh) would hold
    up root's probe at every run: it is reported unreadable, by size, without being read."""
    huge = node["etc"] / "authorized_keys"
    with open(huge, "wb") as handle:
        handle.truncate(64 << 30)  # 64 GiB, sparse: reading it would take minutes
    node["spec"]["paths"].append(str(huge))
    record(node)
    seen = probe(node)
    assert seen["converged"] is False
    unreadable = f"unreadable: {64 << 30} bytes, more than the 16777216 the probe hashes"
    assert seen["reasons"][0].startswith(f"root cannot read path {huge} ({unreadable})"), seen["reasons"]


def test_items_left_when_the_read_budget_runs_out_are_unknown(node):
    record(node)
    seen = module(node["tmp"], mode="probe", path=node["record"], inputs="inputs-1", read_budget_s=0)
    assert seen["converged"] is False
    assert "the probe's 0 s budget ran out before it" in seen["reasons"][0], seen["reasons"]
    assert probe(node)["converged"] is True, "with its budget the same node is converged"


def test_a_path_that_hangs_ends_the_probe_naming_the_node_and_the_path(node):
    """A home on an NFS server that stopped answering (here a FUSE mount whose server never answers):
    the probe's stat blocks in the kernel. Before its watchdog the module never returned."""
    home = node["tmp"] / "home"
    home.mkdir()
    keys = home / ".ssh" / "authorized_keys"
    node["spec"]["paths"].append(str(keys))
    record(node)
    args = node["tmp"] / "hang-args.json"
    args.write_text(
        json.dumps(
            {
                "ANSIBLE_MODULE_ARGS": {
                    "mode": "probe",
                    "path": node["record"],
                    "inputs": "inputs-1",
                    "hang_timeout_s": 2,
                    "node": "ct-worker9",
                }
            }
        )
    )
    with hung_mount(str(home)):
        started = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, str(MODULE), str(args)], capture_output=True, text=True, timeout=30
            )
        except subprocess.TimeoutExpired:
            pytest.fail("the probe hung on the mount (no watchdog)")
        took = time.monotonic() - started
    answer = json.loads(done.stdout)
    assert done.returncode != 0 and answer["failed"] is True, answer
    assert answer["hung"] == f"path {keys}", answer
    assert answer["msg"].startswith(f"ct-worker9: the converged probe waited 2 s on path {keys}"), answer
    assert took < 10, f"it took {took:.1f} s to give up"
