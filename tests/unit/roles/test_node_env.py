"""roles/trainer_env/files/node_env.py and the plan filter: one node builds and packs, the others take
the pack only when its sha256 is the builder's, and a changed venv is seen and repaired.

The script runs as the role runs it (root, the system python, real tar and zstd) on a small venv-like
tree in a temporary dir; the shared dir's pack is read by a real unprivileged account (`nobody`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "roles" / "trainer_env" / "files" / "node_env.py"
PLAN = REPO / "roles" / "trainer_env" / "filter_plugins" / "trainer_env_plan.py"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the role runs node_env.py as root")


def load_plan():
    spec = importlib.util.spec_from_file_location("trainer_env_plan", PLAN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.trainer_env_plan


class Node:
    """One node's places: the venv, the training account's ops dir, root's envs dir."""

    def __init__(self, root: Path):
        self.venv, self.ops, self.envs = (
            root / "opt" / "venv",
            root / "cache" / "ops",
            root / "cache" / "envs",
        )

    def run(self, command: str, *args: str, check: bool = True) -> dict | subprocess.CompletedProcess:
        argv = [sys.executable, "-I", str(SCRIPT), command, "--venv", str(self.venv), "--ops", str(self.ops)]
        done = subprocess.run(
            [*argv, "--envs", str(self.envs), *args], capture_output=True, text=True, timeout=120
        )
        if not check:
            return done
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


def build_venv(node: Node) -> None:
    site = node.venv / "lib" / "python3.11" / "site-packages"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (site / "pkg" / "big.bin").write_bytes(os.urandom(300_000))
    (node.venv / "bin").mkdir()
    (node.venv / "bin" / "python").symlink_to("/usr/bin/python3")
    (node.venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    node.ops.mkdir(parents=True)
    lib = node.ops / "op" / "op.so"
    lib.parent.mkdir()
    lib.write_bytes(b"\x7fELF" + os.urandom(1000))
    info = lib.stat()
    manifest = {"ops": {"op": str(lib)}, "libraries": {str(lib): [info.st_size, info.st_mtime]}}
    (node.ops / "clustertrain-ops.json").write_text(json.dumps(manifest))


@pytest.fixture
def shared(tmp_path):
    """A dir the unprivileged reader can reach (pytest's own tmp dir is root's only)."""
    path = Path("/tmp") / f"clustertrain-test-shared-{os.getpid()}"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=True)


def publish(builder: Node, shared: Path, key: str) -> Path:
    pack = shared / f"{key}.tar.zst"
    pack.write_bytes((builder.envs / f"{key}.tar.zst").read_bytes())
    os.chmod(pack, 0o644)
    return pack


def test_a_pack_unpacks_to_the_same_tree_and_a_changed_venv_is_seen_and_restored(tmp_path, shared):
    builder = Node(tmp_path / "builder")
    build_venv(builder)
    assert builder.run("state")["installed"] is None

    packed = builder.run("pack", "--key", "k1", "--base", "b1", "--built")
    record = packed["installed"]
    assert packed["tree_ok"] and packed["ops_ok"] and packed["pack_cached"] and record["how"] == "built here"
    assert builder.run("pack", "--key", "k1", "--base", "b1")["installed"]["sha256"] == record["sha256"], (
        "the same build packs to the same bytes"
    )

    source = publish(builder, shared, "k1")
    wanted = ["--key", "k1", "--base", "b1", "--sha256", record["sha256"], "--tree", record["tree"]]
    unpack_from_shared = ["--source", str(source), "--reader", "nobody", "--origin", "builder"]
    # The pack's members are the builder's absolute paths, one path on every node: a second node is
    # the builder's places wiped, then unpacked from the shared dir.
    subprocess.run(["rm", "-rf", str(builder.venv), str(builder.ops)], check=True)
    (builder.envs / "installed.json").unlink()
    (builder.envs / "k1.tar.zst").unlink()
    unpacked = builder.run("unpack", *wanted, *unpack_from_shared)
    assert unpacked["did"] == "unpack" and unpacked["tree_ok"] and unpacked["ops_ok"]
    assert (
        unpacked["installed"]["tree"] == record["tree"]
        and unpacked["installed"]["how"] == "unpacked from builder"
    )
    assert (builder.venv / "bin" / "python").is_symlink()

    # Someone edits a file in the venv: the state says so; the node's own pack restores it.
    (builder.venv / "lib" / "python3.11" / "site-packages" / "pkg" / "__init__.py").write_text("VALUE = 2\n")
    assert not builder.run("state")["tree_ok"]
    recorded = (builder.envs / "installed.json").read_bytes()
    restored = builder.run("unpack", *wanted)
    assert restored["did"] == "restore" and restored["tree_ok"]
    # The environment its record describes is back: the record is left as it was (the converged check
    # hashes it: rewritten, the next checked run would be a full one).
    assert (builder.envs / "installed.json").read_bytes() == recorded
    assert restored["installed"]["how"] == "unpacked from builder"
    assert (
        "VALUE = 1"
        in (builder.venv / "lib" / "python3.11" / "site-packages" / "pkg" / "__init__.py").read_text()
    )


def test_a_pack_altered_on_the_shared_dir_is_refused_and_nothing_is_unpacked(tmp_path, shared):
    builder = Node(tmp_path / "builder")
    build_venv(builder)
    record = builder.run("pack", "--key", "k1", "--base", "b1", "--built")["installed"]
    source = publish(builder, shared, "k1")
    with source.open("r+b") as handle:  # the training account rewrites a byte of the published pack
        handle.seek(100)
        handle.write(b"\0")
    other = Node(tmp_path / "other")
    done = other.run(
        "unpack", "--key", "k1", "--base", "b1", "--sha256", record["sha256"], "--tree", record["tree"],
        "--source", str(source), "--reader", "nobody", check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "refused the pack" in done.stderr and record["sha256"] in done.stderr
    assert not other.venv.exists() and not any(other.envs.glob("*.tar.zst")), "nothing unpacked or kept"
    assert not any(other.envs.glob(".*")), "no partial copy left"


def test_the_shared_pack_is_read_as_the_reader_not_as_root(tmp_path, shared):
    """A link planted in the pack's place pointing at a root-only file: the reader cannot read it,
    so root copies nothing of it."""
    builder = Node(tmp_path / "builder")
    build_venv(builder)
    record = builder.run("pack", "--key", "k1", "--base", "b1", "--built")["installed"]
    secret = tmp_path / "root-only"
    secret.write_text("root's secret\n")
    os.chmod(secret, 0o600)
    planted = shared / "k1.tar.zst"
    planted.symlink_to(secret)
    done = Node(tmp_path / "other").run(
        "unpack", "--key", "k1", "--sha256", record["sha256"], "--tree", record["tree"],
        "--source", str(planted), "--reader", "nobody", check=False,
    )  # fmt: skip
    assert done.returncode != 0 and "as nobody" in done.stderr and "Permission denied" in done.stderr


def state(key=None, tree="t1", tree_ok=True, ops_ok=True, pack=True, base=None):
    installed = {"key": key, "base": base or f"base-{key}", "tree": tree, "sha256": "s"} if key else None
    return {"installed": installed, "tree_ok": tree_ok, "ops_ok": ops_ok, "pack_cached": pack and bool(key)}


def entry(key, st, in_play=True, base=None):
    return {"key": key, "base": base or f"base-{key}", "state": st, "in_play": in_play}


def test_the_plan_builds_once_per_key_on_the_head_and_unpacks_elsewhere():
    plan = load_plan()(
        {"w1": entry("cpu", state()), "head": entry("cpu", state()), "g1": entry("gpu", state()),
         "g2": entry("gpu", state())},
        "head",
    )  # fmt: skip
    assert plan["hosts"]["head"]["action"] == "build" and plan["hosts"]["w1"] == {
        "action": "unpack", "why": "no environment yet", "source": "head",
    }  # fmt: skip
    assert plan["hosts"]["g1"]["action"] == "build" and plan["hosts"]["g2"]["action"] == "unpack"
    assert plan["envs"]["gpu"]["source"] == "g1" and all(k["publish"] for k in plan["envs"].values())


def test_the_plan_on_a_converged_cluster_does_nothing_and_repairs_only_what_changed():
    plan = load_plan()
    converged = {h: entry("k", state("k")) for h in ("head", "w1", "w2")}
    assert {h: a["action"] for h, a in plan(converged, "head")["hosts"].items()} == dict.fromkeys(
        converged, "current"
    )
    assert not plan(converged, "head")["envs"]["k"]["publish"]

    tampered = {**converged, "w1": entry("k", state("k", tree_ok=False))}
    assert plan(tampered, "head")["hosts"]["w1"]["action"] == "restore"
    assert "venv changed" in plan(tampered, "head")["hosts"]["w1"]["why"]

    new_wheel = {h: entry("k2", state("k"), base="base-k") for h in converged}
    actions = plan(new_wheel, "head")["hosts"]
    assert actions["head"]["action"] == "update" and actions["w1"]["action"] == "unpack"
    assert "key is k, the inventory's is k2" in actions["w2"]["why"]


def test_a_replacement_node_takes_the_environment_the_head_holds():
    states = {"head": entry("k", state("k"), in_play=False), "new": entry("k", state())}
    plan = load_plan()(states, "head")
    assert plan["hosts"]["new"] == {"action": "unpack", "why": "no environment yet", "source": "head"}
    assert plan["envs"]["k"] == {
        "source": "head",
        "source_action": "current",
        "hosts": ["head", "new"],
        "publish": True,
        "keep": False,
    }
    alone = load_plan()(
        {"head": entry("other", state("other"), in_play=False), "new": entry("k", state())}, "head"
    )
    assert alone["hosts"]["new"]["action"] == "build", "the head holds another key: the new node builds"


def test_a_rebuilt_cluster_starts_from_the_controllers_kept_pack():
    plan = load_plan()
    fresh = {h: entry("k", state()) for h in ("head", "w1")}
    kept = {"k": {"key": "k", "base": "base-k", "sha256": "s", "tree": "t"}}
    seeded = plan(fresh, "head", kept)
    assert seeded["hosts"]["head"]["action"] == "seed" and seeded["hosts"]["head"]["seed"] == "k"
    assert seeded["hosts"]["w1"]["action"] == "unpack" and not seeded["envs"]["k"]["keep"]
    other_wheel = {"old": {"key": "old", "base": "base-k", "sha256": "s", "tree": "t"}}
    updated = plan(fresh, "head", other_wheel)
    assert updated["hosts"]["head"]["action"] == "seed-update" and updated["hosts"]["head"]["seed"] == "old"
    assert not updated["envs"]["k"]["keep"], "one kept pack per stack: the next cluster updates it again"
    other_stack = {"x": {"key": "x", "base": "another", "sha256": "s", "tree": "t"}}
    built = plan(fresh, "head", other_stack)
    assert built["hosts"]["head"]["action"] == "build" and built["envs"]["k"]["keep"]
