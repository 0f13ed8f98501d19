"""torch's JIT extension builds (DeepSpeed's ops): where they live, and build locks nobody holds.

torch builds an extension under `<root>/<name>/` and guards the build with a `lock` file it creates
with O_EXCL and keeps open until the build ends (torch.utils.file_baton). A process killed during
the build never removes it, and every later load of that extension then waits on it forever,
silently. A lock is stale when no process of its owner has it open; that is checked in /proc.

The roots: TORCH_EXTENSIONS_DIR (trainer_env's .pth sets it, for the training user only, to a
node-local dir where the ops are built at provisioning time: trainer.extensions_dir) and torch's
default, `${XDG_CACHE_HOME:-~/.cache}/torch_extensions`, where an earlier job may have built (and
left a lock). Used on the nodes by trainer_env's op build, preflight's node facts and `trainer
launch`'s start check. Standard library only.

    python -m trainer.torch_extensions check                    JSON: roots, locks, stale locks, manifest
    python -m trainer.torch_extensions remove-stale [--newer-than EPOCH]   JSON: what was removed
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from trainer.extensions_dir import default_dir

#: Written into the extensions dir by trainer_env's build: {"ops": {name: path of the .so}, ...}.
MANIFEST = "clustertrain-ops.json"
LOCK_NAME = "lock"


def default_root(environ: dict[str, str] | None = None) -> Path:
    """torch's own default root (torch._appdirs.user_cache_dir('torch_extensions') on Linux)."""
    return Path(default_dir(environ))


def extension_roots(environ: dict[str, str] | None = None) -> list[Path]:
    """The configured root (TORCH_EXTENSIONS_DIR), then torch's default; existing ones only."""
    environ = dict(os.environ if environ is None else environ)
    roots = []
    if environ.get("TORCH_EXTENSIONS_DIR"):
        roots.append(Path(environ["TORCH_EXTENSIONS_DIR"]))
    roots.append(default_root(environ))
    seen: list[Path] = []
    for root in roots:
        if root.is_dir() and root.resolve() not in [s.resolve() for s in seen]:
            seen.append(root)
    return seen


def find_locks(roots: list[Path]) -> list[Path]:
    """Lock files of extension builds: <root>/<name>/lock, or <root>/<py311_cpu>/<name>/lock."""
    found: list[Path] = []
    for root in roots:
        for pattern in (f"*/{LOCK_NAME}", f"*/*/{LOCK_NAME}"):
            found.extend(path for path in root.glob(pattern) if path.is_file())
    return sorted(set(found))


def holders(path: Path, owner_uid: int | None = None) -> list[int]:
    """PIDs that have `path` open. Only processes of `owner_uid` (and any we can read) are looked at:
    the training user builds in its own dirs, and it can read its own processes' fds."""
    try:
        target = os.stat(path)
    except OSError:
        return []
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if owner_uid is not None and proc.stat().st_uid not in (owner_uid, os.getuid()):
                continue
            for fd in (proc / "fd").iterdir():
                try:
                    info = os.stat(fd)
                except OSError:
                    continue
                if (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino):
                    found.append(int(proc.name))
                    break
        except OSError:  # gone, or not ours to read
            continue
    return found


def describe_lock(path: Path, now: float | None = None) -> dict:
    info = path.stat()
    owner = holders(path, info.st_uid)
    # A library older than the lock: the op was built before, the lock is from a load (torch takes
    # it for its up-to-date check too), so the library is whole.
    built_before = any(lib.stat().st_mtime < info.st_mtime for lib in path.parent.glob("*.so"))
    return {
        "path": str(path),
        "op_dir": str(path.parent),
        "op": path.parent.name,
        "age_s": round((now or time.time()) - info.st_mtime, 1),
        "mtime": info.st_mtime,
        "uid": info.st_uid,
        "holders": owner,
        "stale": not owner,
        "built_before": built_before,
    }


def read_manifest(root: Path) -> dict | None:
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def check(environ: dict[str, str] | None = None) -> dict:
    """What preflight and the launcher need: the configured dir, its manifest, every lock."""
    environ = dict(os.environ if environ is None else environ)
    configured = environ.get("TORCH_EXTENSIONS_DIR") or ""
    locks = []
    for path in find_locks(extension_roots(environ)):
        try:
            locks.append(describe_lock(path))
        except OSError:
            continue  # released while we looked
    manifest = read_manifest(Path(configured)) if configured else None
    built = {}
    for name, library in ((manifest or {}).get("ops") or {}).items():
        built[name] = bool(library) and os.path.isfile(library)
    return {
        "configured_dir": configured,
        "default_dir": str(default_root(environ)),
        "manifest": manifest,
        "built": built,
        "locks": locks,
        "stale": [lock for lock in locks if lock["stale"]],
    }


def stale_lock_fix(lock: dict, host: str = "this node", user: str = "the training user") -> str:
    """The exact fix for one stale lock."""
    return (
        f"on {host}, as {user}: rm -rf {lock['op_dir']} (a DeepSpeed start killed while it compiled "
        f"left {lock['path']}; no process holds it, and every DeepSpeed start there waits on it "
        "forever); then build the ops ahead of time: ansible-playbook site.yml --tags trainer_env"
    )


def remove_stale(environ: dict[str, str] | None = None, newer_than: float | None = None) -> list[dict]:
    """Remove every stale lock: the lock alone where the op's library was built before it (a load
    was stopped), else the op's dir with its half-built files. `newer_than` (epoch seconds): only
    locks made since then, i.e. by a job of ours that was stopped."""
    removed = []
    for path in find_locks(extension_roots(environ)):
        try:
            lock = describe_lock(path)
        except OSError:
            continue
        if not lock["stale"] or (newer_than is not None and lock["mtime"] < newer_than):
            continue
        if lock["built_before"]:
            Path(lock["path"]).unlink(missing_ok=True)
        else:
            shutil.rmtree(lock["op_dir"], ignore_errors=True)
        lock["removed"] = not os.path.exists(lock["path"])
        removed.append(lock)
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.torch_extensions")
    parser.add_argument("action", choices=("check", "remove-stale"))
    parser.add_argument("--newer-than", type=float, default=None, help="epoch seconds (remove-stale)")
    args = parser.parse_args(argv)
    if args.action == "check":
        print(json.dumps(check()))
    else:
        print(json.dumps({"removed": remove_stale(newer_than=args.newer_than)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
