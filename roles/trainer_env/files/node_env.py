"""The node environment's life cycle on one node (trainer_env): read it, pack it, unpack a verified pack.

    python3 -I node_env.py state  --venv V --ops O --envs E
    python3 -I node_env.py pack   --venv V --ops O --envs E --key K
    python3 -I node_env.py unpack --venv V --ops O --envs E --key K --sha256 S --tree T [--source FILE]

Run by root with the system python (standard library only; tar and zstd from the OS). Every command
prints one JSON object: the node's state after it ran (what `state` prints), with what it did.

The environment is the training venv V (root's) and DeepSpeed's prebuilt ops O (the training
account's dir, which the venv points that account's torch at). It is built once per key, on one
node, and packed there into E/<key>.tar.zst (root's, node-local); every other node of that key gets
the pack through the shared dir, which the training account can write, so a pack that came that way
is trusted only after its sha256 matches the one the builder's root reported to the controller.
E/installed.json (root's) says which key the node holds, the pack's sha256 and the venv's tree
digest: a venv changed since (a file edited, a package installed by hand) no longer matches it.

Why not trust more: the shared dir, the staging file a node copies the pack into and the ops dir
are the training account's or reachable by it, so nothing there is followed as a link, read twice or
unpacked before its hash is checked on a root-owned copy.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import platform
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECORD = "installed.json"
#: The pack's layout and how its venv is built; a new one is a new key (trainer_env's key has it).
#: 3: the build compiles the venv's bytecode (1 and 2 had none where uv installed the stack).
FORMAT = 3
#: CPU features DeepSpeed's CPU op builders compile for (their -march/-D__AVX512__ choices): nodes
#: that differ in these must not share a build of the ops.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
ISA_FLAGS += ("amx_tile",)


def os_release() -> str:
    fields = {}
    for line in Path("/etc/os-release").read_text().splitlines():
        name, _, value = line.partition("=")
        fields[name] = value.strip().strip('"')
    return f"{fields.get('ID', '?')} {fields.get('VERSION_ID', '?')}"


def cpu_isa() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    rows = (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags"))
    flags = next(rows, [])
    return [flag for flag in ISA_FLAGS if flag in flags]


def tree_digest(venv: Path) -> str | None:
    """Every entry of the venv but __pycache__ (each account's python may write there): its path,
    type, mode, owner, size, mtime and link target. Changes when anything is edited, added or
    removed; a stat per file (about 0.3 s for torch and the training stack), no content read."""
    if not venv.is_dir():
        return None
    digest = hashlib.sha256()
    for top, dirs, files in os.walk(venv):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(dirs + files):
            path = os.path.join(top, name)
            info = os.lstat(path)
            link = os.readlink(path) if stat.S_ISLNK(info.st_mode) else ""
            row = (
                os.path.relpath(path, venv),
                stat.S_IFMT(info.st_mode),
                stat.S_IMODE(info.st_mode),
                info.st_uid,
                info.st_gid,
                info.st_size if not stat.S_ISDIR(info.st_mode) else 0,
                info.st_mtime_ns if not stat.S_ISDIR(info.st_mode) else 0,
                link,
            )
            digest.update(repr(row).encode() + b"\n")
    return digest.hexdigest()


def ops_state(ops: Path) -> tuple[dict, bool]:
    """The ops the last build recorded (deepspeed_ops.py's manifest) and whether each library is
    still as built (size and mtime): the training account can delete or replace them."""
    try:
        manifest = json.loads((ops / "clustertrain-ops.json").read_text())
        built = manifest["ops"]
        stamps = manifest["libraries"]
        ok = all([os.stat(path).st_size, os.stat(path).st_mtime] == stamps[path] for path in built.values())
        return built, ok
    except (OSError, ValueError, KeyError, TypeError):
        return {}, False


def read_record(envs: Path) -> dict | None:
    try:
        record = json.loads((envs / RECORD).read_text())
        return record if isinstance(record, dict) and "key" in record else None
    except (OSError, ValueError):
        return None


def state(args, tree: str | None = None) -> dict:
    """The node's state; `tree`: the venv's digest when the caller has just read it (a walk of the
    whole venv, not to be done twice)."""
    venv, ops, envs = Path(args.venv), Path(args.ops), Path(args.envs)
    record = read_record(envs)
    tree = tree or tree_digest(venv)
    built, ops_ok = ops_state(ops)
    pack = envs / f"{record['key']}.tar.zst" if record else None
    site = sorted(glob.glob(str(venv / "lib" / "python3*" / "site-packages")))
    return {
        "python": ".".join(map(str, sys.version_info[:3])),
        "os": os_release(),
        "machine": platform.machine(),
        "cpu_isa": cpu_isa(),
        "format": FORMAT,
        "installed": record,
        "tree": tree,
        "tree_ok": bool(record and tree and record.get("tree") == tree),
        "ops": built,
        "ops_ok": ops_ok,
        "pack_cached": bool(pack and pack.is_file() and pack.stat().st_size == record.get("size")),
        "site_packages": site[0] if site else "",
    }


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def rel(path: Path) -> str:
    return str(path.resolve()).lstrip("/")


def write_record(envs: Path, record: dict) -> None:
    partial = envs / f".{RECORD}.{os.getpid()}"
    partial.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    os.chmod(partial, 0o644)
    os.replace(partial, envs / RECORD)


def drop_other_packs(envs: Path, key: str) -> list[str]:
    """One pack per node: the one of the key it holds (a replaced key's pack is of no use)."""
    dropped = []
    for old in envs.glob("*.tar.zst"):
        if old.name != f"{key}.tar.zst":
            old.unlink()
            dropped.append(old.name)
    return dropped


def pack(args) -> dict:
    """Pack the venv and the ops (tar, zstd): names sorted, owners numeric, no atime/ctime, so the
    same build packs to the same bytes. The mtimes are the build's: ninja and the ops' manifest
    compare them, and they must agree on every node."""
    venv, ops, envs = Path(args.venv), Path(args.ops), Path(args.envs)
    envs.mkdir(mode=0o755, parents=True, exist_ok=True)
    started = time.monotonic()
    members = [rel(venv)] + ([rel(ops)] if ops.is_dir() else [])
    target = envs / f"{args.key}.tar.zst"
    partial = envs / f".{args.key}.tar.zst.{os.getpid()}"
    tar = subprocess.Popen(
        ["tar", "--create", "--file=-", "--format=posix", "--sort=name", "--numeric-owner",
         "--pax-option=delete=atime,delete=ctime", "-C", "/", "--", *members],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    with partial.open("wb") as out:
        zstd = subprocess.run(["zstd", "-q", "-T0", "-3", "-c"], stdin=tar.stdout, stdout=out, check=False)
    tar.stdout.close()
    if tar.wait() != 0 or zstd.returncode != 0:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"packing {venv} failed (tar rc {tar.returncode}, zstd rc {zstd.returncode})")
    os.chmod(partial, 0o644)
    os.replace(partial, target)
    packed_s = time.monotonic() - started
    record = {
        "key": args.key,
        "base": args.base,
        "sha256": sha256_of(target),
        "size": target.stat().st_size,
        "tree": (tree := tree_digest(venv)),
        "members": members,
        "how": "built here" if args.built else "packed here",
        "pack_s": round(packed_s, 1),
    }
    write_record(envs, record)
    drop_other_packs(envs, args.key)
    return {"changed": True, "did": "pack", "seconds": {"pack": round(packed_s, 1)}, **state(args, tree)}


def copy_verified(source: str, dest: Path, reader: str, timeout_s: int) -> str:
    """Copy `source` (on the shared dir, the training account's) into a new root-owned `dest`,
    hashing what is copied. Root does not open `source`: the shared dir squashes root, and a path
    the training account controls is never followed by root. `reader` (that account) reads it in a
    child process and root takes the bytes from a pipe, once. Returns the hash of what was copied."""
    digest = hashlib.sha256()
    out = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    # `timeout`: a FIFO planted in the pack's place would hold the run forever.
    cat = subprocess.Popen(
        ["timeout", str(timeout_s), "cat", "--", source], user=reader, group=pwd.getpwnam(reader).pw_gid,
        extra_groups=[], cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    with os.fdopen(out, "wb") as handle:
        while block := cat.stdout.read(1 << 20):
            digest.update(block)
            handle.write(block)
    error = cat.stderr.read().decode(errors="replace").strip()
    if cat.wait() != 0:
        raise SystemExit(f"could not read the pack {source} as {reader}: {error or f'rc {cat.returncode}'}")
    return digest.hexdigest()


def swap_in(unpacked: Path, final: Path) -> Path | None:
    """Put `unpacked` where `final` is (a rename where both are on one filesystem). Returns the old
    one, moved aside, for `remove_later`."""
    final.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    old = final.parent / f".{final.name}.old-{os.getpid()}"
    if os.path.lexists(final):
        os.rename(final, old)
    shutil.move(unpacked, final)
    return old if os.path.lexists(old) else None


def remove_later(paths: list[Path]) -> None:
    """Remove replaced trees in the background: a 1.6 GB venv took minutes to delete on a loaded
    node, all of it in the provision's critical path. rm does not follow links (the old ops dir is
    the training account's); a new session keeps it alive when Ansible's connection closes."""
    if paths:
        subprocess.Popen(
            ["rm", "-rf", "--one-file-system", "--", *map(str, paths)], start_new_session=True,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip


def extract(pack_path: Path, places: dict[str, Path]) -> list[Path]:
    """Unpack the pack once into a fresh root-made dir beside the venv, then swap each member in:
    nothing the training account planted where the ops dir is can redirect what root writes. Each
    member's own dir keeps the builder's mode and owner (the ops dir: the training account's).
    Returns the replaced trees, moved aside."""
    first = next(iter(places.values()))
    first.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{first.name}.unpack-", dir=first.parent))
    replaced = []
    try:
        subprocess.run(
            ["tar", "--extract", "--zstd", "--file", str(pack_path), "--same-owner", "--same-permissions",
             "-C", str(staging)],
            check=True,
        )  # fmt: skip
        for member, final in places.items():
            if (staging / member).is_dir() and (old := swap_in(staging / member, final)):
                replaced.append(old)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return replaced


def unpack(args) -> dict:
    venv, ops, envs = Path(args.venv), Path(args.ops), Path(args.envs)
    envs.mkdir(mode=0o755, parents=True, exist_ok=True)
    target = envs / f"{args.key}.tar.zst"
    seconds = {}
    started = time.monotonic()
    if args.source:
        partial = envs / f".{args.key}.tar.zst.{os.getpid()}"
        try:
            got = copy_verified(args.source, partial, args.reader, args.timeout)
            if got != args.sha256:
                raise SystemExit(
                    f"refused the pack {args.source}: its sha256 is {got}, the builder's is {args.sha256} "
                    "(changed on the shared dir since it was published); nothing was unpacked. Fix: rerun "
                    "site.yml, which publishes the builder's pack again."
                )
            os.chmod(partial, 0o644)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
        seconds["copy"] = round(time.monotonic() - started, 1)
    elif sha256_of(target) != args.sha256:
        raise SystemExit(f"refused {target}: its sha256 is not the recorded {args.sha256}; nothing unpacked")
    started = time.monotonic()
    members = [rel(venv), rel(ops)]
    replaced = extract(target, dict(zip(members, (venv, ops), strict=True)))
    seconds["unpack"] = round(time.monotonic() - started, 1)
    tree = tree_digest(venv)
    if tree != args.tree:
        raise SystemExit(f"{venv} unpacked from {target} differs from the builder's ({tree} != {args.tree})")
    record = {
        "key": args.key,
        "base": args.base,
        "sha256": args.sha256,
        "size": target.stat().st_size,
        "tree": tree,
        "members": members,
        "how": f"unpacked from {args.origin}" if args.origin else "restored from this node's pack",
    }
    held = read_record(envs)
    # A restore from the node's own pack puts back the environment its record describes: the record
    # stays as it is, byte for byte. Rewritten (its `how` changed), it read as a new environment to
    # the converged check, which hashes it, and the next checked site.yml was a full run for nothing.
    restored_as_recorded = (
        not args.source
        and held
        and all(held.get(field) == record[field] for field in ("key", "sha256", "tree"))
    )
    if not restored_as_recorded:
        write_record(envs, record)
    drop_other_packs(envs, args.key)
    remove_later(replaced)
    did = "unpack" if args.source else "seed" if args.origin else "restore"
    return {"changed": True, "did": did, "seconds": seconds, **state(args, tree)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["state", "pack", "unpack"])
    parser.add_argument("--venv", required=True)
    parser.add_argument("--ops", required=True)
    parser.add_argument("--envs", required=True)
    parser.add_argument("--key", default="")
    parser.add_argument("--base", default="", help="the key without this project's wheel (for the record)")
    parser.add_argument("--sha256", default="")
    parser.add_argument("--tree", default="")
    parser.add_argument("--source", default="", help="unpack: the shared dir's pack (default: own)")
    parser.add_argument("--reader", default="", help="unpack --source: the training account, which reads it")
    parser.add_argument("--timeout", type=int, default=900, help="unpack --source: the copy's limit (s)")
    parser.add_argument("--origin", default="", help="the node that built the pack (for the record)")
    parser.add_argument("--built", action="store_true", help="pack: the venv was built by this run")
    args = parser.parse_args()
    if args.command != "state" and not args.key.isalnum():
        parser.error(f"--key must be letters and digits (got {args.key!r})")
    if args.command == "state":
        result = {"changed": False, **state(args)}
    elif args.command == "pack":
        result = pack(args)
    else:
        result = unpack(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
