"""Training data prepared once per cluster: one process reads, tokenizes and packs the data
(training_data.build_training_data) and writes the result into a cache directory every node sees; every
other process waits for it and memory-maps it, and a later run with the same inputs reuses it. On N
nodes × G processes that is one preparation instead of N×G, and one copy of the arrays in each node's
page cache instead of G in its memory.

The cache (data.prepared_dir; '' = <cluster_shared_dir>/prepared-data under `trainer launch`, else
OUTPUT_DIR/prepared-data) holds, per set of inputs (`cache_key`):

    <key>/             a complete preparation, written as <key>.tmp-<token>/ and renamed into place
                       whole (after an fsync), so a crash never leaves a half-written <key>/
        meta.json      the inputs, notes, facts, array sizes, who prepared it and when (JSON: nothing
                       is unpickled, no code runs from the cache)
        *.npy          the arrays (np.save without pickles), memory-mapped read-only by every reader
        done           written last: an entry without it, or whose arrays are not the sizes meta.json
                       names, is never used (it is moved aside and prepared again)
    <key>.lock/        while a process prepares: owner.json (host, rank, pid, job) and heartbeat,
                       rewritten every HEARTBEAT_S; error.json once the preparer stopped on bad input

Who prepares: global rank 0 at once; a node's local rank 0 too when nothing has appeared in the cache
after GRACE_S (a node that does not share the directory then prepares its own copy, in a directory of
the same name on its own disk); the lock (an atomic mkdir) makes it exactly one process per file
system. The others wait: while the lock's heartbeat goes on, as long as it takes (a large dataset may
take hours), saying so every WAIT_NOTICE_S; a preparer gone (its pid, on this host; its heartbeat
silent for STALE_AFTER_S, on any) is taken over by the first waiter to notice; nobody preparing at all
for NO_PREPARER_S is an error naming the ranks that should have. Bad input (a ConfigError) is written
to the lock, so every rank stops at once with the same key and message, not after a timeout.

Trust: the directory must be this account's and writable by nobody else (a cache another account
could write would let it choose what this job trains on); it is refused otherwise. Everything is
opened relative to the checked directory, without following links.

Size: each preparation removes the entries beyond the KEEP_ENTRIES used last whose last use is older
than KEEP_USED_WITHIN_S (a running job memory-maps its entry; on NFS, deleting it under the job would
fail its reads). Delete the directory by hand, with no job running from it, to reclaim all of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import socket
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer.configerror import ConfigError
from trainer.joblock import job_from_env, process_alive, process_start
from trainer.node.data import DataError
from trainer.node.hf import dataset
from trainer.node.hf.packing import Rows
from trainer.node.hf.sources import data_fingerprint
from trainer.node.hf.training_data import TrainingData, build_training_data

if TYPE_CHECKING:
    from trainer.node.config import TrainerConfig

#: Bumped when the entry layout or meta.json changes (older entries are then simply not found).
FORMAT_VERSION = 1
HEARTBEAT_S = 10.0
#: Longer than NFS's longest attribute cache (60 s), so a live preparer's beat is always seen in time.
STALE_AFTER_S = 120.0
#: How long a node's local rank 0 gives global rank 0 to claim the preparation before it claims it.
GRACE_S = 5.0
NO_PREPARER_S = 600.0
WAIT_NOTICE_S = 30.0
KEEP_ENTRIES = 4
KEEP_USED_WITHIN_S = 86400.0
#: Config keys of the data section that do not change what is prepared (the cache's own, the built-in
#: GPT's, and what happens to the samples after preparation). Every other key is part of the cache key,
#: including keys added later: keying too much costs a preparation, keying too little trains on stale data.
NOT_DATA_INPUTS = frozenset(
    {"block_size", "repeats", "allow_dataset_oversubscription", "prepare_once", "prepared_dir"}
)
#: Model keys that are the built-in GPT's shape or the weights' (the tokenizer is hashed by content).
NOT_MODEL_INPUTS = frozenset({"n_layer", "n_head", "n_embd", "dropout", "bias", "name_or_path", "dtype"})
ARRAYS = ("train_ids", "train_labels", "train_offsets", "rows_members", "rows_offsets")
EVAL_ARRAYS = ("eval_ids", "eval_labels", "eval_offsets")


@dataclass(frozen=True)
class Process:
    """This process's place in the job, from torchrun's environment (set before the process group)."""

    rank: int = 0
    local_rank: int = 0
    host: str = dataclasses.field(default_factory=socket.gethostname)
    job: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Process:
        env = dict(os.environ if env is None else env)
        run_id = env.get("TORCHELASTIC_RUN_ID", "")
        return cls(
            rank=int(env.get("RANK", "0")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            job=job_from_env(env) or ("" if run_id in ("", "none") else run_id),
        )


# --- what the preparation depends on -------------------------------------------------------------


def cache_key(config: TrainerConfig, tokenizer: Any) -> tuple[str, dict[str, Any]]:
    """(key, inputs): the data's content, the tokenizer, the data section, model.max_length (and the
    model keys that could matter), the seed where the eval split uses it, the preparing code and the
    libraries it calls."""
    data = {k: v for k, v in dataclasses.asdict(config.data).items() if k not in NOT_DATA_INPUTS}
    inputs = {
        "format_version": FORMAT_VERSION,
        "data": data,
        "model": {k: v for k, v in dataclasses.asdict(config.model).items() if k not in NOT_MODEL_INPUTS},
        # The eval split (and, with several datasets, a weight below 1) draws with it.
        "seed": config.train.seed,
        "content": data_fingerprint(config),  # every source by content, s3 by ETag
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "code": _code_fingerprint(),
        "libraries": _library_versions(),
    }
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:32]
    return key, inputs


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """The tokenizer as loaded (its files, or a hub id's download, both end up here): the fast
    tokenizer's whole serialized state (vocabulary, merges, normalizer, added tokens), the chat template,
    the special tokens and the plain settings it was created with."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = (
        backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    )
    settings = {
        k: v
        for k, v in getattr(tokenizer, "init_kwargs", {}).items()
        if isinstance(v, str | int | float | bool) and not k.endswith("_file") and k != "name_or_path"
    }
    return _sha256(
        type(tokenizer).__name__.encode(),
        vocabulary.encode(),
        (getattr(tokenizer, "chat_template", None) or "").encode(),
        json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str).encode(),
        json.dumps(settings, sort_keys=True).encode(),
    )


def _code_fingerprint() -> str:
    """The preparing code (this package): an upgrade that changes how data is read or tokenized must
    not reuse what the old code prepared."""
    package = Path(__file__).parent
    files = sorted(package.rglob("*.py"))
    return _sha256(*(part for p in files for part in (str(p.relative_to(package)).encode(), p.read_bytes())))


def _library_versions() -> dict[str, str]:
    found = {}
    for name in ("transformers", "tokenizers", "jinja2", "numpy"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def _sha256(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))  # parts cannot run into each other
        digest.update(part)
    return digest.hexdigest()


# --- the entry point -----------------------------------------------------------------------------


def default_dir(config: TrainerConfig, env: dict[str, str] | None = None) -> Path:
    """data.prepared_dir, or where it defaults to: the cluster's shared dir under `trainer launch`
    (which runs every job in <cluster_shared_dir>/runs/<run name> and says so in CLUSTER_OUTPUT_DIR),
    else OUTPUT_DIR/prepared-data."""
    if config.data.prepared_dir:
        return Path(config.data.prepared_dir).expanduser().absolute()
    env = os.environ if env is None else env
    output_dir = Path(config.output_dir).expanduser().absolute()
    launched = env.get("CLUSTER_OUTPUT_DIR", "")
    if launched and Path(launched).absolute() == output_dir and output_dir.parent.name == "runs":
        return output_dir.parent.parent / "prepared-data"
    return output_dir / "prepared-data"


def training_data(
    config: TrainerConfig,
    tokenizer: Any,
    *,
    process: Process | None = None,
    say: Callable[[str], None] | None = None,
    keep: bool = True,
) -> TrainingData:
    """What build_training_data(config, tokenizer) returns, prepared by one process of the job (see
    the module docstring); data.prepare_once=false: built here, by this process, as before. The last
    note says which (prepared, or reused and by whom). keep=False (a dry run): built here, nothing
    written."""
    if not config.data.prepare_once or not keep:
        return build_training_data(config, tokenizer)
    process = process or Process.from_env()
    say = say or _say_on_stderr(process)
    key, inputs = cache_key(config, tokenizer)
    cache = PreparedCache(default_dir(config), explicit=bool(config.data.prepared_dir))
    build = lambda: build_training_data(config, tokenizer)  # noqa: E731
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 and not cache.root.exists():
        # One process and no cache yet: nobody waits for it, so the data is built (and bad input
        # refused) before anything is written: a refused run leaves no directory behind.
        build = _built_ahead(build, tokenizer)
    return cache.get(key, inputs, build, tokenizer, process, say)


def _built_ahead(build: Callable[[], TrainingData], tokenizer: Any) -> Callable[[], TrainingData]:
    """Build now; the returned build gives the result and makes the same change to the tokenizer
    (ChatML for one without a template) then, where the cache records what the preparation did."""
    before = getattr(tokenizer, "chat_template", None)
    built = build()
    after = getattr(tokenizer, "chat_template", None)
    tokenizer.chat_template = before

    def replay() -> TrainingData:
        tokenizer.chat_template = after
        return built

    return replay


def _say_on_stderr(process: Process) -> Callable[[str], None]:
    # One line per node is enough while waiting; rank 0's notes reach the run's log through the reporter.
    def say(message: str) -> None:
        if process.local_rank == 0:
            print(f"trainer: rank {process.rank}: {message}", file=sys.stderr, flush=True)

    return say


# --- the cache -----------------------------------------------------------------------------------


class Unusable(Exception):
    """An entry that is not complete or not intact; the message says why."""


@dataclass
class PreparedCache:
    root: Path
    explicit: bool = False
    """data.prepared_dir was set: a directory that cannot be used is a ConfigError, not a fallback."""
    heartbeat_s: float = HEARTBEAT_S
    stale_after_s: float = STALE_AFTER_S
    grace_s: float = GRACE_S
    no_preparer_s: float = NO_PREPARER_S
    poll_s: float = 0.2

    def get(
        self,
        key: str,
        inputs: dict[str, Any],
        build: Callable[[], TrainingData],
        tokenizer: Any,
        process: Process,
        say: Callable[[str], None],
    ) -> TrainingData:
        try:
            root_fd = self._open_root()
        except OSError as err:
            if self.explicit:
                raise ConfigError(
                    "data.prepared_dir", f"cannot use {self.root}: {err.strerror or err}"
                ) from None
            # No place to keep it (a dry run on a machine without the shared dir): this process builds.
            data = build()
            data.notes.append(
                f"data: prepared by every process (no cache: cannot use {self.root}: {err.strerror or err})"
            )
            return data
        try:
            return _Session(self, root_fd, key, inputs, build, tokenizer, process, say).run()
        finally:
            os.close(root_fd)

    def _open_root(self) -> int:
        """The cache dir, created if missing (as this account's, 0750), opened without following a
        link; ConfigError unless it is this account's and only it can write it."""
        with contextlib.suppress(FileExistsError):
            self.root.mkdir(parents=True, mode=0o750)
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            _check_owned(os.fstat(fd), self.root, "data.prepared_dir")
        except ConfigError:
            os.close(fd)
            raise
        return fd


def _check_owned(info: os.stat_result, path: Path | str, key: str = "data.prepared_dir") -> None:
    if info.st_uid != os.geteuid():
        raise ConfigError(
            key,
            f"{path} belongs to uid {info.st_uid}, not to this account (uid {os.geteuid()}): prepared data "
            "another account could write is never used; set data.prepared_dir to a directory of this "
            "account's (or data.prepare_once=false)",
        )
    if info.st_mode & 0o022:
        raise ConfigError(
            key,
            f"{path} is writable by {'others' if info.st_mode & 0o002 else 'its group'} (mode "
            f"{stat.S_IMODE(info.st_mode):04o}): another account could change what this job trains on; "
            f"chmod go-w {path}, or set data.prepared_dir elsewhere",
        )


class _Session:
    """One process's way to the entry `key`: reuse it, wait for it, or prepare it."""

    def __init__(self, cache, root_fd, key, inputs, build, tokenizer, process, say):
        self.cache, self.root_fd, self.key, self.inputs = cache, root_fd, key, inputs
        self.build, self.tokenizer, self.process, self.say = build, tokenizer, process, say
        self.lock_name = f"{key}.lock"
        self.token = uuid.uuid4().hex
        self.started = time.monotonic()
        self.started_wall = time.time()

    @property
    def where(self) -> Path:
        return self.cache.root / self.key

    def run(self) -> TrainingData:
        claim_after = (
            0.0 if self.process.rank == 0 else self.cache.grace_s if self.process.local_rank == 0 else None
        )
        beat_seen: tuple[str, float] | None = None  # (heartbeat text, when it last changed)
        last_notice = self.started
        while True:
            try:
                return self._reuse()
            except FileNotFoundError:
                broken = None
            except Unusable as why:
                broken = str(why)
            owner, error, beat = self._read_lock()
            now = time.monotonic()
            if owner is not None or beat is not None:
                if error is not None and self._is_ours(error):
                    raise _error_from(error)
                if beat_seen is None or beat_seen[0] != beat:
                    beat_seen = (beat or "", now)
                stale = self._why_stale(owner, error, now - beat_seen[1])
                if stale and self._take_over(beat):
                    self.say(f"data: took over preparing {self.where} from {_who(owner)}, which {stale}")
                    return self._prepare(broken)
                if now - last_notice >= WAIT_NOTICE_S:
                    last_notice = now
                    self.say(
                        f"data: waiting for {_who(owner)} to prepare {self.where} "
                        f"({now - self.started:.0f} s so far)"
                    )
            else:
                beat_seen = None
                waited = now - self.started
                if claim_after is not None and waited >= claim_after and self._claim():
                    return self._prepare(broken)
                if claim_after is None and waited >= self.cache.no_preparer_s:
                    raise DataError(
                        f"no process prepared the data in {self.where} within "
                        f"{self.cache.no_preparer_s:.0f} s: rank 0 (or this node's local rank 0) should "
                        "have; see its log for why it did not"
                    )
                if now - last_notice >= WAIT_NOTICE_S:
                    last_notice = now
                    self.say(
                        f"data: waiting for a process to start preparing {self.where} ({waited:.0f} s so far)"
                    )
            # Quick at first (the preparer of a small dataset is done in seconds), gentler on the file
            # server later: up to 2 s between looks.
            time.sleep(min(2.0, self.cache.poll_s + 0.1 * (time.monotonic() - self.started)))

    # --- reusing -------------------------------------------------------------------------------

    def _reuse(self) -> TrainingData:
        data, meta = load_entry(self.root_fd, self.key)
        _touch(self.root_fd, self.key)
        _replay_tokenizer(self.tokenizer, meta)
        by = meta["prepared_by"]
        line = (
            f"data: reused prepared data {self.where} (prepared {by['at']} by {by['host']} rank {by['rank']})"
        )
        data.notes.append(line)
        if self.process.rank != 0:  # rank 0's line is its last note, in the run's log
            self.say(line)
        return data

    # --- the lock ------------------------------------------------------------------------------

    def _read_lock(self) -> tuple[dict | None, dict | None, str | None]:
        """(owner, error, heartbeat text); all None without a lock. A lock just made has no owner yet."""
        try:
            fd = os.open(self.lock_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.root_fd)
        except FileNotFoundError:
            return None, None, None
        try:
            return (
                _read_json(fd, "owner.json"),
                _read_json(fd, "error.json"),
                _read_text(fd, "heartbeat") or "",
            )
        finally:
            os.close(fd)

    def _is_ours(self, error: dict) -> bool:
        """An error record from this job (the same job id; without one, written since this process
        started, with a margin for the nodes' clocks): a later job tries again."""
        if self.process.job or error.get("job"):
            return error.get("job") == self.process.job
        return float(error.get("written", 0)) >= self.started_wall - 120

    def _why_stale(self, owner: dict | None, error: dict | None, silent_s: float) -> str:
        if error is not None:
            return "stopped on an error in another job"
        if (
            owner
            and owner.get("host") == self.process.host
            and not process_alive(owner.get("pid"), owner.get("pid_start"))
        ):
            return f"is gone (pid {owner.get('pid')} no longer runs)"
        if silent_s > self.cache.stale_after_s:
            return f"gave no heartbeat for {silent_s:.0f} s"
        return ""

    def _claim(self) -> bool:
        try:
            os.mkdir(self.lock_name, 0o750, dir_fd=self.root_fd)
        except FileExistsError:
            return False
        # Held open from here on: what this process writes goes to its own lock, even after a waiter
        # that judged it dead (frozen, not gone) moved it aside and made a new one of the same name.
        self.lock_fd = os.open(
            self.lock_name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=self.root_fd
        )
        owner = {
            "host": self.process.host,
            "rank": self.process.rank,
            "pid": os.getpid(),
            "pid_start": process_start(os.getpid()),
            "job": self.process.job,
            "token": self.token,
            "since": time.time(),
        }
        _write_file(self.lock_fd, "owner.json", json.dumps(owner).encode())
        _write_file(self.lock_fd, "heartbeat", f"{self.token} 0\n".encode())
        return True

    def _take_over(self, beat_judged: str | None) -> bool:
        """Move the stale lock aside whole (one waiter wins the rename) and claim a fresh one."""
        aside = f"{self.key}.stale-{self.token}"
        if self._read_lock()[2] != beat_judged:
            return False  # it beat meanwhile: not stale after all
        try:
            os.rename(self.lock_name, aside, src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)
        except FileNotFoundError:
            return False
        shutil.rmtree(aside, dir_fd=self.root_fd, ignore_errors=True)
        return self._claim()

    @contextlib.contextmanager
    def _heartbeat(self) -> Iterator[None]:
        stop = threading.Event()

        def beat() -> None:
            count = 0
            while not stop.wait(self.cache.heartbeat_s):
                count += 1
                # Rewritten in place and closed each time: NFS readers see it at their next open.
                with contextlib.suppress(OSError):
                    fd = os.open("heartbeat", os.O_WRONLY | os.O_NOFOLLOW, dir_fd=self.lock_fd)
                    try:
                        os.pwrite(fd, f"{self.token} {count}\n".encode(), 0)
                    finally:
                        os.close(fd)

        thread = threading.Thread(target=beat, name="prepared-data-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _still_ours(self) -> bool:
        owner = self._read_lock()[0]
        return bool(owner) and owner.get("token") == self.token

    def _release(self) -> None:
        if self._still_ours():
            aside = f"{self.key}.done-{self.token}"
            with contextlib.suppress(OSError):
                os.rename(self.lock_name, aside, src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)
                shutil.rmtree(aside, dir_fd=self.root_fd, ignore_errors=True)
        os.close(self.lock_fd)

    # --- preparing -----------------------------------------------------------------------------

    def _prepare(self, broken: str | None) -> TrainingData:
        try:
            data, cpu, wall = self._build(broken)
        except _Reusable:
            self._release()
            return self._reuse()
        except _TakenOver:  # this process stood still long enough to be judged dead: the new owner's
            self._release()
            return self.run()
        committed = write_entry(self.root_fd, self.key, data, self._meta(data, cpu, wall), self.token)
        self._release()
        if not committed:  # the process that took over from this one committed first
            return self._reuse()
        prune(self.root_fd, keep=self.key)
        line = f"data: prepared {self.where} in {wall:.1f} s ({cpu:.1f} CPU s) for every process"
        if self.process.rank != 0:  # rank 0's line is its last note, in the run's log
            self.say(line)
        # The page cache's copy, shared with the node's other processes, not this one's own.
        loaded, _ = load_entry(self.root_fd, self.key)
        loaded.notes.append(line)
        return loaded

    def _build(self, broken: str | None) -> tuple[TrainingData, float, float]:
        with contextlib.suppress(FileNotFoundError, Unusable):
            load_entry(self.root_fd, self.key)
            raise _Reusable  # finished by another between our last look and our claim
        if broken is not None or _exists(self.root_fd, self.key):
            self.say(f"data: {self.where} is not usable ({broken or 'incomplete'}): preparing it again")
            _remove(self.root_fd, self.key, self.token)
        for name in os.listdir(self.root_fd):  # a dead preparer's partial copy: ours to clear now
            if name.startswith(f"{self.key}.tmp-"):
                shutil.rmtree(name, dir_fd=self.root_fd, ignore_errors=True)
        self.template_before = getattr(self.tokenizer, "chat_template", None)
        with self._heartbeat():
            cpu, wall = time.process_time(), time.monotonic()
            try:
                data = self.build()
            except ConfigError as err:
                self._write_error({"kind": "config", "key": err.key, "problem": err.problem})
                raise
            except BaseException as err:
                self._write_error({"kind": "crash", "message": f"{type(err).__name__}: {err}"})
                raise
            if not self._still_ours():
                raise _TakenOver
            return data, time.process_time() - cpu, time.monotonic() - wall

    def _meta(self, data: TrainingData, cpu: float, wall: float) -> dict[str, Any]:
        template = getattr(self.tokenizer, "chat_template", None)
        return {
            "format_version": FORMAT_VERSION,
            "key": self.key,
            "inputs": self.inputs,
            "notes": data.notes,
            "facts": data.facts,
            "has_eval": data.eval is not None,
            # What the preparation did to the tokenizer (ChatML for one without a template): replayed.
            "chat_template": template if template != self.template_before else None,
            "prepared_by": {
                "host": self.process.host,
                "rank": self.process.rank,
                "pid": os.getpid(),
                "at": datetime.now(UTC).isoformat(timespec="seconds"),
                "seconds": round(wall, 3),
                "cpu_seconds": round(cpu, 3),
            },
        }

    def _write_error(self, record: dict[str, Any]) -> None:
        """Bad input, for every waiting rank to stop with at once (see _is_ours)."""
        record |= {
            "host": self.process.host,
            "rank": self.process.rank,
            "job": self.process.job,
            "written": time.time(),
        }
        try:
            if self._still_ours():
                with contextlib.suppress(OSError):
                    _write_file(self.lock_fd, "error.json", json.dumps(record).encode())
        finally:
            os.close(self.lock_fd)


class _Reusable(Exception):
    pass


class _TakenOver(Exception):
    pass


def _who(owner: dict | None) -> str:
    return f"{owner.get('host')} rank {owner.get('rank')}" if owner else "the preparing process"


def _error_from(error: dict) -> Exception:
    if error.get("kind") == "config":
        return ConfigError(str(error.get("key", "")), str(error.get("problem", "")))
    return DataError(
        f"the process preparing the data ({error.get('host')} rank {error.get('rank')}) failed: "
        f"{error.get('message')}; its log has the traceback"
    )


def _replay_tokenizer(tokenizer: Any, meta: dict[str, Any]) -> None:
    """What the preparation did to the tokenizer (ChatML given to one without a chat template), done
    again: the final model's tokenizer is the same whether the data was prepared or reused."""
    if meta.get("chat_template"):
        tokenizer.chat_template = meta["chat_template"]


# --- the entry on disk ---------------------------------------------------------------------------


def write_entry(root_fd: int, key: str, data: TrainingData, meta: dict[str, Any], token: str) -> bool:
    """Write <key>.tmp-<token>/ whole (each file fsynced, `done` last), then rename it to <key>. False
    if <key> appeared meanwhile (our copy is dropped)."""
    tmp = f"{key}.tmp-{token}"
    os.mkdir(tmp, 0o750, dir_fd=root_fd)
    tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
    try:
        sizes = {}
        for name, array in _arrays(data):
            fd = os.open(
                f"{name}.npy", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640, dir_fd=tmp_fd
            )
            with os.fdopen(fd, "wb") as handle:
                np.save(handle, np.ascontiguousarray(array), allow_pickle=False)
                handle.flush()
                os.fsync(handle.fileno())
            sizes[name] = {"dtype": str(array.dtype), "length": len(array)}
        _write_file(tmp_fd, "meta.json", json.dumps(meta | {"arrays": sizes}, indent=1).encode())
        _write_file(tmp_fd, "done", key.encode())
        os.fsync(tmp_fd)
    finally:
        os.close(tmp_fd)
    try:
        os.rename(tmp, key, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    except OSError:
        if not _exists(root_fd, key):
            raise
        shutil.rmtree(tmp, dir_fd=root_fd, ignore_errors=True)
        return False
    os.fsync(root_fd)
    return True


def _arrays(data: TrainingData) -> Iterator[tuple[str, np.ndarray]]:
    yield from (("train_ids", data.train.ids), ("train_labels", data.train.labels))
    yield from (("train_offsets", data.train.offsets), ("rows_members", data.rows.members))
    yield "rows_offsets", data.rows.offsets
    if data.eval is not None:
        yield from (("eval_ids", data.eval.ids), ("eval_labels", data.eval.labels))
        yield "eval_offsets", data.eval.offsets


def load_entry(root_fd: int, key: str) -> tuple[TrainingData, dict[str, Any]]:
    """The entry memory-mapped (read-only) with its meta.json; FileNotFoundError if there is none,
    Unusable if it is incomplete, not this account's, or its arrays are not what meta.json says."""
    entry_fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
    try:
        try:
            _check_owned(os.fstat(entry_fd), key)
        except ConfigError as err:
            raise Unusable(err.problem) from None
        if _read_text(entry_fd, "done") != key:
            raise Unusable("no done marker (a preparation that never finished)")
        meta = _read_json(entry_fd, "meta.json")
        if not meta or meta.get("key") != key or meta.get("format_version") != FORMAT_VERSION:
            raise Unusable("meta.json is missing or names another entry")
        names = ARRAYS + (EVAL_ARRAYS if meta.get("has_eval") else ())
        arrays = {name: _map(entry_fd, name, meta.get("arrays", {}).get(name)) for name in names}
    finally:
        os.close(entry_fd)
    train = dataset.Samples(arrays["train_ids"], arrays["train_labels"], arrays["train_offsets"])
    held_out = (
        dataset.Samples(arrays["eval_ids"], arrays["eval_labels"], arrays["eval_offsets"])
        if meta.get("has_eval")
        else None
    )
    rows = Rows(members=arrays["rows_members"], offsets=arrays["rows_offsets"])
    for samples in (train, held_out):
        if samples is not None and not (
            len(samples.offsets) >= 1 and samples.offsets[-1] == len(samples.ids) == len(samples.labels)
        ):
            raise Unusable("the sample arrays do not agree with their offsets")
    if (
        not len(rows.offsets)
        or rows.offsets[-1] != len(rows.members)
        or (len(rows.members) and rows.members.max() >= len(train))
    ):
        raise Unusable("the rows do not agree with the samples")
    data = TrainingData(train=train, eval=held_out, rows=rows, notes=list(meta["notes"]), facts=meta["facts"])
    return data, meta


def _map(entry_fd: int, name: str, expected: dict | None) -> np.ndarray:
    if not expected:
        raise Unusable(f"meta.json does not describe {name}")
    try:
        fd = os.open(f"{name}.npy", os.O_RDONLY | os.O_NOFOLLOW, dir_fd=entry_fd)
    except FileNotFoundError:
        raise Unusable(f"{name}.npy is missing") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise Unusable(f"{name}.npy is not a regular file")
        try:
            _check_owned(info, name)
        except ConfigError as err:
            raise Unusable(err.problem) from None
        # np.load maps a path only; the /proc path names the file already opened and checked.
        array = np.asarray(np.load(f"/proc/self/fd/{fd}", mmap_mode="r", allow_pickle=False))
    except (ValueError, OSError) as err:
        raise Unusable(f"{name}.npy cannot be read: {err}") from None
    finally:
        os.close(fd)
    if str(array.dtype) != expected.get("dtype") or len(array) != expected.get("length") or array.ndim != 1:
        raise Unusable(
            f"{name}.npy is not the {expected.get('dtype')} array of {expected.get('length')} meta.json names"
        )
    return array


# --- upkeep --------------------------------------------------------------------------------------


def _touch(root_fd: int, key: str) -> None:
    """Mark a use (the done marker's mtime): what pruning keeps."""
    with contextlib.suppress(OSError):
        entry_fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
        try:
            os.utime("done", dir_fd=entry_fd, follow_symlinks=False)
        finally:
            os.close(entry_fd)


def prune(root_fd: int, *, keep: str, now: float | None = None) -> list[str]:
    """Remove entries beyond the KEEP_ENTRIES used last that nobody used for KEEP_USED_WITHIN_S, and
    leftovers (aside, temporary) as old; the names removed."""
    now = time.time() if now is None else now
    used = []
    removed = []
    for name in os.listdir(root_fd):
        # An entry's last use is its done marker's mtime, a lock's its heartbeat's; else the dir's own.
        marker = (
            f"{name}/heartbeat" if name.endswith(".lock") else f"{name}/done" if "." not in name else name
        )
        try:
            info = os.stat(marker, dir_fd=root_fd, follow_symlinks=False)
        except FileNotFoundError:
            info = None
        with contextlib.suppress(OSError):
            info = info or os.stat(name, dir_fd=root_fd, follow_symlinks=False)
        if info is None:
            continue
        if "." in name:
            if now - info.st_mtime > KEEP_USED_WITHIN_S:
                shutil.rmtree(name, dir_fd=root_fd, ignore_errors=True)
                removed.append(name)
        elif name != keep:
            used.append((info.st_mtime, name))
    for last_used, name in sorted(used, reverse=True)[KEEP_ENTRIES - 1 :]:
        if now - last_used > KEEP_USED_WITHIN_S:
            _remove(root_fd, name, uuid.uuid4().hex)
            removed.append(name)
    return removed


def _remove(root_fd: int, name: str, token: str) -> None:
    """Out of sight at once (a rename), then deleted."""
    aside = f"{name}.bad-{token}"
    with contextlib.suppress(FileNotFoundError):
        os.rename(name, aside, src_dir_fd=root_fd, dst_dir_fd=root_fd)
        shutil.rmtree(aside, dir_fd=root_fd, ignore_errors=True)


def _exists(root_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _write_file(dir_fd: int, name: str, content: bytes) -> None:
    """name, whole or not at all: written beside it, fsynced, renamed over it."""
    tmp = f".{name}.{uuid.uuid4().hex}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640, dir_fd=dir_fd)
    try:
        os.write(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def _read_text(dir_fd: int, name: str) -> str | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb", closefd=False) as handle:
            return handle.read().decode(errors="replace")
    finally:
        os.close(fd)


def _read_json(dir_fd: int, name: str) -> dict | None:
    text = _read_text(dir_fd, name)
    if text is None:
        return None
    with contextlib.suppress(ValueError):
        found = json.loads(text)
        return found if isinstance(found, dict) else None
    return None
