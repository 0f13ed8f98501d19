"""`trainer push -i INVENTORY LOCAL_PATH [NAME]`: a model or dataset from this machine onto the shared dir.

The shared dir is the head's export (every node mounts it at the same path) and only the training
account may write it, so the copy goes to the head, as that account: `<shared>/models/NAME` for a
model directory (it has config.json or adapter_config.json), `<shared>/datasets/NAME` for anything else
(a dataset directory or one file); `--kind` says it where the guess is wrong. The copy is rsync's
(trainer.controller.rsync_to_host): resumable (run the same command again after an interruption),
with progress, and checked at the end by a checksum of every file on both sides. It ends with the line
to put in the training config.

Everything this command is given is checked before any host is touched: the local path, NAME (one
path component: letters, digits, '.', '_', '-'; no '/' or '..'), the inventory (the rule book
`trainer launch` applies) and the head's connection.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from trainer import exitcodes
from trainer.controller.access import add_vault_argument, configure_access
from trainer.controller.inventory import InventoryError, load_cluster
from trainer.controller.rsync_to_host import (
    PARTIAL_DIR,
    CopyError,
    Target,
    compare,
    copy,
    describe,
    human_size,
    target_for,
)

EXAMPLES = (
    "trainer push -i inventory/mycluster ~/models/Qwen2.5-0.5B  # -> <shared>/models/Qwen2.5-0.5B",
    "trainer push -i inventory/mycluster ./chats.jsonl support-chats  # -> <shared>/datasets/support-chats",
    "trainer push -i inventory/mycluster ./tokenized --kind data --bwlimit 50000  # at most 50 MB/s",
)

#: NAME: one path component, safe on every shell line and file system (no '/', no leading '.').
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
#: What a directory holds when it is a Hugging Face model (or a PEFT adapter) directory.
MODEL_FILES = ("config.json", "adapter_config.json")


@dataclass(frozen=True)
class Kind:
    """Where a pushed thing goes on the shared dir and which config key names it there."""

    subdir: str
    config_key: str


KINDS = {
    "model": Kind("models", "model.name_or_path"),
    "data": Kind("datasets", "data.path"),
    # Your own training code, for `trainer launch -- COMMAND` (it runs in training_workdir).
    "code": Kind("code", ""),
}


class PushError(Exception):
    """Bad input: nothing was contacted or changed. The message names the problem and the fix."""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--inventory", required=True, help="inventory directory or file")
    parser.add_argument(
        "local_path", type=Path, metavar="LOCAL_PATH", help="a model or dataset directory, or one file"
    )
    parser.add_argument(
        "name",
        nargs="?",
        metavar="NAME",
        help="its name on the shared dir (default: LOCAL_PATH's own name): letters, digits, '.', '_', '-'",
    )
    parser.add_argument(
        "--kind",
        choices=("auto", *KINDS),
        default="auto",
        help="model (to <shared>/models), data (to <shared>/datasets) or code (to <shared>/code: your "
        "own script or project, for trainer launch -- COMMAND); auto: a directory with "
        f"{' or '.join(MODEL_FILES)} is a model, anything else data (default: %(default)s)",
    )
    parser.add_argument(
        "--delete",
        action="store_true",
        help="also remove files under NAME on the shared dir that LOCAL_PATH does not have (a model "
        "pushed again with fewer shards); without it they stay, and the push lists them",
    )
    parser.add_argument(
        "--bwlimit",
        type=int,
        default=0,
        metavar="KB",
        help="at most KB kilobytes (1024 bytes) per second, to leave the network to a running job "
        "(default: no limit)",
    )
    add_vault_argument(parser)
    parser.epilog = (
        "The copy runs on the head as the training account (cluster_training_user) with rsync over the "
        "inventory's ssh connection: the login account (ansible_user) needs passwordless sudo to it, or "
        "is it. Interrupted, the same command resumes where it stopped."
    )


def run(args: argparse.Namespace) -> int:
    try:
        request = check_request(args)
    except (PushError, InventoryError, CopyError) as err:
        print(f"trainer push: {err}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    restore = _interrupt_on_term()
    try:
        return push(request, args)
    finally:
        restore()


@dataclass(frozen=True)
class Request:
    """A push that passed every check: what goes where, as whom."""

    source: Path
    name: str
    kind: Kind
    destination: str
    target: Target
    files: int
    size: int


def check_request(args: argparse.Namespace) -> Request:
    """Every check that needs no host, in the order a user would fix them; PushError, InventoryError or
    CopyError (a connection push cannot use) otherwise."""
    if args.bwlimit < 0:
        raise PushError(f"--bwlimit must be 0 (no limit) or more kilobytes per second, not {args.bwlimit}")
    source = args.local_path.expanduser()
    if not source.exists():
        raise PushError(f"{args.local_path} does not exist: give the model or dataset directory (or file)")
    if not (source.is_dir() or source.is_file()):
        raise PushError(f"{args.local_path} is neither a directory nor a regular file: give one of those")
    source = source.resolve()
    if outside := links_leading_outside(source):
        raise PushError(
            "; ".join(outside[:10])
            + (f"; and {len(outside) - 10} more" if len(outside) > 10 else "")
            + f": a push follows a link only where it stays inside {args.local_path} (or, in a Hugging "
            "Face cache snapshot, leads into the cache's blobs/), since it reads what the link points to as "
            "you and puts it on the shared dir; replace each with the file itself, or remove it"
        )
    files, size = _count(source)
    if not files:
        raise PushError(f"{args.local_path} holds no file: nothing to push")
    name = args.name if args.name is not None else source.name
    if not NAME.fullmatch(name) or ".." in name:
        given = "NAME" if args.name is not None else f"the name of {args.local_path}"
        raise PushError(
            f"{given} {name!r} cannot name a directory on the shared dir: use one path component of letters, "
            "digits, '.', '_' and '-' that starts with a letter or digit (no '/', no '..', no spaces), e.g. "
            f"{_suggest(name)}" + ("" if args.name is not None else " (give it as NAME after LOCAL_PATH)")
        )
    kind = KINDS[args.kind] if args.kind != "auto" else _guess_kind(source)
    configure_access(args)
    cluster = load_cluster(args.inventory)
    head = cluster.head
    shared = str(head.get("cluster_shared_dir") or "")
    user = str(head.get("cluster_training_user") or "")
    if not shared.startswith("/") or not user:
        raise PushError(
            f"inventory {args.inventory}: the head {head.name} needs cluster_shared_dir (an absolute path) "
            "and cluster_training_user: set them in group_vars/cluster (storage.yml, cluster.yml)"
        )
    destination = str(PurePosixPath(shared) / kind.subdir / name)
    return Request(source, name, kind, destination, target_for(head, user), files, size)


def push(request: Request, args: argparse.Namespace) -> int:
    target = request.target
    where = f"{target.host}:{request.destination}"
    print(
        f"pushing {request.source} ({request.files} file{'s' if request.files != 1 else ''}, "
        f"{human_size(request.size)}) to {where} as {target.training_user}",
        flush=True,
    )
    # A directory's contents go into NAME; a file becomes NAME.
    source = f"{request.source}/" if request.source.is_dir() else str(request.source)
    try:
        stats = copy(
            target,
            source,
            request.destination,
            delete=args.delete,
            bwlimit_kib=args.bwlimit,
            progress=_progress_printer(),
        )
        if sys.stderr.isatty():
            print(file=sys.stderr)  # end the progress line rewritten in place
        print(describe(stats), flush=True)
        found = compare(target, source, request.destination)
    except KeyboardInterrupt:
        print(
            f"\ntrainer push: interrupted; what was copied stays on {target.host} (a half-copied file in "
            f"{PARTIAL_DIR}/ beside it): run the same command again to go on from there",
            file=sys.stderr,
        )
        return exitcodes.INTERRUPTED
    except CopyError as err:
        print(f"trainer push: {err}", file=sys.stderr)
        return exitcodes.FAILURE
    if found.differ:
        print(
            f"trainer push: after the copy, {len(found.differ)} file(s) on {target.host} still differ from "
            f"{request.source} by checksum: {', '.join(found.differ[:5])}; run the same command again (a "
            "file changed during the copy, or the shared dir's disk is failing)",
            file=sys.stderr,
        )
        return exitcodes.FAILURE
    print(f"checksums: all {request.files} file(s) on {target.host} match {request.source}")
    if found.extra:
        print(
            f"note: {where} also has {len(found.extra)} file(s) that {request.source} has not "
            f"({', '.join(found.extra[:5])}); push again with --delete to remove them"
        )
    if not request.kind.config_key:  # code: run it from there
        print(
            f"run it on every node by its path there, e.g.:\n  trainer launch -i INVENTORY -- torchrun "
            f"{request.destination}{'' if request.source.is_file() else '/train.py'}"
        )
        return exitcodes.OK
    print(f"put this in your training config:\n  {request.kind.config_key}: {request.destination}")
    return exitcodes.OK


def links_leading_outside(source: Path) -> list[str]:
    """`LINK is a link to TARGET` for every link under `source` (resolved) that leads outside it, other
    than a Hugging Face cache snapshot's links into its repository's blobs/ (`source` is
    `.../models--ORG--NAME/snapshots/REVISION`, a link resolves inside `.../models--ORG--NAME/blobs`, a
    real directory). A tree someone else prepared (an unpacked archive, a clone with committed links)
    could otherwise make the push read the operator's files and copy them to the share."""
    if not source.is_dir():
        return []
    blobs = source.parent.parent / "blobs"
    allowed = [source] + ([blobs] if blobs.is_dir() and not blobs.is_symlink() else [])
    found = []
    for root, dirs, names in os.walk(source):
        for name in [*dirs, *names]:
            path = Path(root) / name
            if not path.is_symlink():
                continue
            target = path.resolve()
            if not any(target.is_relative_to(base) for base in allowed):
                found.append(f"{path} is a link to {target}")
    return found


def _count(source: Path) -> tuple[int, int]:
    """(files, bytes) that a push of `source` copies (a link's target counted as the file)."""
    if source.is_file():
        return 1, source.stat().st_size
    files = size = 0
    for root, _, names in os.walk(source):
        if PARTIAL_DIR in Path(root).relative_to(source).parts:
            continue
        for name in names:
            try:
                size += (Path(root) / name).stat().st_size
                files += 1
            except OSError:  # a dangling link: rsync says so by name
                continue
    return files, size


def _guess_kind(source: Path) -> Kind:
    if source.is_dir() and any((source / name).is_file() for name in MODEL_FILES):
        return KINDS["model"]
    return KINDS["data"]


def _suggest(name: str) -> str:
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name.replace("..", ".")).strip("-._")
    return cleaned[:64] or "my-model"


def _progress_printer() -> Callable[[str], None]:
    """Progress on stderr: one line rewritten in place on a terminal, else a line each time."""
    if sys.stderr.isatty():
        return lambda line: print(f"\r{line:<60}", end="", file=sys.stderr, flush=True)
    return lambda line: print(f"progress: {line}", file=sys.stderr, flush=True)


def _interrupt_on_term() -> Callable[[], None]:
    """TERM and HUP end the push as Ctrl-C does (rsync keeps its partial file); returns what puts the
    previous handlers back."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    return restore
