"""Where a fine-tune's data comes from: data.path (or each entry of data.datasets, or data.eval_path)
resolved into a `DataSource`, read through Hugging Face `datasets`, and fingerprinted by content.

What a path may be (the suffix decides, a compression suffix such as `.gz` aside):
- `.json` / `.jsonl` / `.ndjson`, `.csv` / `.tsv`, `.parquet`, `.arrow`: records, read by the `datasets`
  builder of that name (a glob such as `data/*.parquet` too);
- `.txt` / `.md` / `.text`: plain text, cut into model.max_length pieces (every token trained);
- a directory: a `Dataset.save_to_disk` directory (DatasetDict: data.split), else a directory of data
  files that `datasets` reads as a dataset (a hub snapshot);
- `s3://bucket/key`: any of the above on S3 or an S3-compatible store (data.s3_endpoint_url or
  AWS_ENDPOINT_URL), through fsspec's s3fs as `datasets` reads it; credentials from the standard AWS
  variables or profile only;
- `org/name` that is no local path: a hub dataset id, where a hub is reachable;
- '' : the bundled English text of the standard library (`pydoc_data.topics`), as plain text.
Anything else is refused by name before training (a file of another kind is never trained as text).

This module is loaded with the config on the controller: `datasets`, `s3fs` and numpy are imported
inside the functions that read.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.configerror import ConfigError
from trainer.node.checkpoint import content_hash, file_hash

if TYPE_CHECKING:
    from datasets import Dataset

    from trainer.node.config import TrainerConfig
    from trainer.node.data import DataConfig

#: Chat template settings that name a bundled template (anything else is a Jinja file's path).
NAMED_TEMPLATES = ("tokenizer", "chatml", "llama3")

BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
TEXT_SUFFIXES = (".txt", ".md", ".text")
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
#: A hub id: `org/name`, one slash, no scheme (tried only where no such local path exists).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class DataSource:
    path: str
    key: str = "data.path"
    """The config key that named it, for errors (`data.datasets[1].path`)."""
    format: str = "auto"
    weight: float = 1.0
    columns: dict[str, str] = field(default_factory=dict)
    split: str = "train"

    @property
    def name(self) -> str:
        return self.path or "the bundled text"

    @property
    def section(self) -> str:
        """The key of this source's settings (`data`, `data.datasets[1]`) for format and column errors."""
        return self.key.rsplit(".", 1)[0]

    @property
    def remote(self) -> bool:
        return self.path.startswith("s3://")


@dataclass(frozen=True)
class Location:
    kind: str
    """bundled, text, files (a builder on data files), saved (save_to_disk), folder (a directory of
    data files) or hub."""
    builder: str = ""


def data_sources(data: DataConfig) -> list[DataSource]:
    """The training sources, in config order: data.datasets, else data.path alone."""
    if not data.datasets:
        return [DataSource(data.path, "data.path", data.format, 1.0, dict(data.columns), data.split)]
    return [
        DataSource(
            path=entry["path"],
            key=f"data.datasets[{index}].path",
            format=entry.get("format", data.format),
            weight=float(entry.get("weight", 1.0)),
            columns=dict(entry.get("columns", {})),
            split=entry.get("split", "train"),
        )
        for index, entry in enumerate(data.datasets)
    ]


def eval_source(data: DataConfig, train_format: str) -> DataSource | None:
    """data.eval_path read as the training data's format (and its column mapping when there is one
    dataset), or None."""
    if not data.eval_path:
        return None
    columns = dict(data.columns) if not data.datasets else {}
    return DataSource(data.eval_path, "data.eval_path", train_format, 1.0, columns, data.split)


# --- locating and reading -------------------------------------------------------------------------


def _suffix(path: str) -> str:
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    for compression in COMPRESSIONS:
        name = name.removesuffix(compression)
    return Path(name).suffix


def storage_options(endpoint: str) -> dict[str, Any]:
    """fsspec's options for s3:// paths: the endpoint only; botocore finds the credentials (environment,
    profile, instance role) and AWS_ENDPOINT_URL itself. A fresh dict per call: `datasets` adds to it."""
    return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}


def locate(source: DataSource, endpoint: str = "") -> Location:
    """What kind of data source.path is; ConfigError naming source.key for what cannot be read."""
    path = source.path
    if not path:
        return Location("bundled")
    suffix = _suffix(path)
    local = Path(path).expanduser()
    if not source.remote and not local.exists() and not any(c in path for c in "*?["):
        if HUB_ID.fullmatch(path) and not suffix:
            return Location("hub")
        raise ConfigError(source.key, f"no such file or directory: {local}")
    if suffix in TEXT_SUFFIXES:
        return Location("text")
    if suffix in BUILDERS:
        return Location("files", BUILDERS[suffix])
    if source.remote:
        if suffix:
            raise _unknown_kind(source, suffix)
        return Location("saved")  # a prefix: read as a save_to_disk directory (refused by name if not)
    if local.is_dir():
        saved = (local / "dataset_info.json").is_file() and (local / "state.json").is_file()
        return Location("saved" if saved or (local / "dataset_dict.json").is_file() else "folder")
    return _sniff(source, local)


def _sniff(source: DataSource, local: Path) -> Location:
    """A local file whose suffix says nothing: parquet by its magic bytes, JSON by its first character,
    plain text if it is UTF-8, else refused by name."""
    with open(local, "rb") as handle:
        head = handle.read(4096)
    if head.startswith(b"PAR1"):
        return Location("files", "parquet")
    if head.lstrip()[:1] in (b"{", b"["):
        return Location("files", "json")
    try:
        head.decode("utf-8")
        binary = b"\x00" in head
    except UnicodeDecodeError as err:
        # A character cut at the end of a full sample is still text.
        binary = len(head) < 4096 or err.start < len(head) - 4
    if binary:
        raise _unknown_kind(source, local.suffix or "(none)")
    return Location("text")


def _unknown_kind(source: DataSource, suffix: str) -> ConfigError:
    return ConfigError(
        source.key,
        f"{source.path}: cannot tell what kind of data a {suffix} file is; give it the suffix of what it "
        f"holds: {', '.join(BUILDERS)} (records), {', '.join(TEXT_SUFFIXES)} (plain text), or a "
        "save_to_disk directory",
    )


@dataclass
class Loaded:
    """What a source holds: records (a `datasets.Dataset`, columns mapped) or one plain text."""

    source: DataSource
    records: Dataset | list[dict[str, Any]] | None = None
    """Records as `datasets` reads them, or as parsed by us where it would change their values."""
    text: str | None = None


def bundled_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def read(source: DataSource, endpoint: str = "") -> Loaded:
    """Read a source; ConfigError naming source.key (and the reason) for anything that cannot be."""
    location = locate(source, endpoint)
    if location.kind == "bundled":
        return Loaded(source, text=bundled_text())
    if location.kind == "text":
        return Loaded(source, text=_read_text(source, endpoint))
    import datasets

    # Every rank would draw its own progress bars and cache notes into the one log; a file it cannot
    # read is said once, in our words (below), not again by its logger.
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        with _hub_switch_for(source, datasets):
            records = _load(datasets, source, location, endpoint)
    except ConfigError:
        raise
    except Exception as err:  # datasets, pyarrow, fsspec and botocore each raise their own
        raise _file_problem(source, location) or _read_error(source, location, err) from None
    if location.builder == "json" and not source.columns:
        _refuse_wrapper(source, records)
    if location.builder == "json" and _has_json_feature(records.features):
        # A field whose values differ in type from record to record (OpenAI's content: a list of parts
        # in one message, a string in the next) is kept by `datasets` as its Json type, which decodes
        # the string "4." as the number 4.0: such a file is parsed by us, its values as written.
        records = _parsed_records(source, location, endpoint) or records
    return Loaded(source, records=_map_columns(records, source))


def _has_json_feature(feature: Any) -> bool:
    """Whether a `datasets` feature (or one nested in it) is its Json type (values of mixed types)."""
    if type(feature).__name__ == "Json":
        return True
    if isinstance(feature, dict):
        return any(_has_json_feature(value) for value in feature.values())
    inner = getattr(feature, "feature", None)
    return inner is not None and inner is not feature and _has_json_feature(inner)


def _parsed_records(source: DataSource, location: Location, endpoint: str) -> list[dict[str, Any]] | None:
    """The records of a JSON or JSON lines source parsed with Python's json; None where we cannot."""
    if source.remote:
        import fsspec

        try:
            with fsspec.open(source.path, "rb", compression="infer", **storage_options(endpoint)) as handle:
                texts = [handle.read().decode("utf-8")]
        except Exception:
            return None
    else:
        texts = [_local_text(file) for file in _local_files(source)]
        if any(text is None for text in texts):
            return None
    records: list[dict[str, Any]] = []
    for text in texts:
        body = (text or "").lstrip("\ufeff")
        try:
            parsed = json.loads(body)
            records += parsed if isinstance(parsed, list) else [parsed]
        except json.JSONDecodeError:
            records += [json.loads(line) for line in body.splitlines() if line.strip()]
    return records if all(isinstance(record, dict) for record in records) else None


@contextlib.contextmanager
def _hub_switch_for(source: DataSource, datasets: Any) -> Iterator[None]:
    """HF_HUB_OFFLINE governs the model hub only: `datasets` also refuses every remote URL under it
    (`OfflineModeIsEnabled: Tried to reach s3://...`), and clusters without a hub set it. An s3://
    source is read with the switch off; a hub id (the only source that reaches the hub) keeps it."""
    if not source.remote or not datasets.config.HF_HUB_OFFLINE:
        yield
        return
    datasets.config.HF_HUB_OFFLINE = False
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = True


# --- a file the library cannot read, in our words --------------------------------------------------

#: json's messages, in plain words (the rest are shown as json says them).
JSON_REASONS = {
    "Unterminated string starting at": "a string is not closed (the line may be cut short)",
    "Expecting ',' delimiter": "a comma is missing between two values",
    "Expecting ':' delimiter": 'a ":" is missing after a field name',
    "Expecting property name enclosed in double quotes": (
        "a field name is not in double quotes (or a comma is left before a closing brace)"
    ),
    "Expecting value": "a value is missing or is not JSON (strings need double quotes; true, false, null)",
    "Extra data": "more than one JSON value where one record was expected",
    "Invalid control character at": "a raw tab or line break inside a string (write it as \\t or \\n)",
    "Invalid \\escape": "a backslash that starts no JSON escape (write \\\\ for a backslash)",
}
OPENERS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}


def _file_problem(source: DataSource, location: Location) -> ConfigError | None:
    """Where `datasets` failed on a local file, the file read by us: an empty one, or for JSON and JSON
    lines the first broken record at FILE:LINE:COL (1-based) with the reason in plain words and the fix.
    None where ours finds nothing (the library's own message is then the best there is)."""
    if source.remote or location.kind != "files":
        return None
    for file in _local_files(source):
        text = _local_text(file)
        if text is None:
            continue
        if not text.strip():
            why = "the file is empty" if not text else "only blank lines"
            return ConfigError(source.key, f"{file} holds no records ({why})")
        if location.builder == "json" and (problem := _json_error(file, text)):
            return ConfigError(source.key, problem)
    return None


def _local_files(source: DataSource) -> list[Path]:
    """The local file source.path names, or the files its glob matches."""
    local = Path(source.path).expanduser()
    return [local] if local.is_file() else sorted(p for p in local.parent.glob(local.name) if p.is_file())


def _local_text(file: Path) -> str | None:
    """A local data file's text (decompressed where Python's standard library can), or None."""
    name = file.name.lower()
    opener = next((module for suffix, module in OPENERS.items() if name.endswith(suffix)), None)
    if opener is None and any(name.endswith(suffix) for suffix in COMPRESSIONS):
        return None
    try:
        raw = importlib.import_module(opener).open(file).read() if opener else file.read_bytes()
        return raw.decode("utf-8")
    except (OSError, EOFError, ValueError):
        return None


def _json_error(file: Path, text: str) -> str | None:
    """The first broken record of a JSON (a list) or JSON lines file, as FILE:LINE:COL: reason; fix."""
    body = text.lstrip("\ufeff")
    try:
        json.loads(body)
        return None  # one JSON document: what the library could not read is not its syntax
    except json.JSONDecodeError as err:
        first = next(line for line in body.splitlines() if line.strip())
        # A list, or one object spread over lines (its first line alone is no JSON): one document.
        if body.lstrip().startswith("[") or not _is_json(first):
            return f"{file}:{err.lineno}:{err.colno}: {_plain(err.msg)}; fix the record"
    for number, line in enumerate(body.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            return f"{file}:{number}:{err.colno}: {_plain(err.msg)}; fix or drop the line"
        if not isinstance(record, dict):
            return (
                f"{file}:{number}:1: a line must be one record, a JSON object {{...}} (got a "
                f"{type(record).__name__}); fix or drop the line"
            )
    return None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _plain(message: str) -> str:
    return next((words for start, words in JSON_REASONS.items() if message.startswith(start)), message)


def _refuse_wrapper(source: DataSource, records: Dataset) -> None:
    """A .json file that is one object holding the records under a field (`{"data": [...]}`) reads as one
    record of that field: refused with what was expected, not trained as one odd record."""
    from trainer.node.hf.formats import looks_like

    if len(records) != 1 or looks_like(records[0]) is not None:
        return
    for name, value in records[0].items():
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            raise ConfigError(
                source.key,
                f"{source.path} is one JSON object whose field `{name}` holds {len(value)} records; a .json "
                "file must be a list of records ([{...}, {...}]) or one record per line: write the list "
                "alone",
            )


def _load(datasets: Any, source: DataSource, location: Location, endpoint: str) -> Dataset:
    options = storage_options(endpoint) if source.remote else None
    if location.kind == "files":
        extra: dict[str, Any] = {"sep": "\t"} if _suffix(source.path) == ".tsv" else {}
        path = source.path if source.remote else str(Path(source.path).expanduser())
        if location.builder == "csv" and (names := _csv_header(source, extra.get("sep", ","))):
            # Every column as text: an answer column of "4." would otherwise be read as the number 4.0.
            extra["features"] = datasets.Features({name: datasets.Value("string") for name in names})
        return datasets.load_dataset(
            location.builder, data_files=path, split=source.split, storage_options=options, **extra
        )
    if location.kind == "saved":
        path = source.path if source.remote else str(Path(source.path).expanduser())
        loaded = datasets.load_from_disk(path, storage_options=options)
        if isinstance(loaded, datasets.DatasetDict):
            if source.split not in loaded:
                raise ConfigError(
                    f"{source.section}.split",
                    f"{source.path} has the splits {', '.join(loaded)}, not {source.split!r}; set "
                    f"{source.section}.split to one of them",
                )
            return loaded[source.split]
        return loaded
    if location.kind == "folder":
        return datasets.load_dataset(str(Path(source.path).expanduser()), split=source.split)
    return datasets.load_dataset(source.path, split=source.split)  # a hub id


def _csv_header(source: DataSource, sep: str) -> list[str] | None:
    """The column names of a local, uncompressed CSV (the first file of a glob); None elsewhere."""
    import csv

    files = [] if source.remote else _local_files(source)
    if not files or files[0].name.lower().endswith(COMPRESSIONS):
        return None
    try:
        with open(files[0], newline="", encoding="utf-8") as handle:
            names = next(csv.reader(handle, delimiter=sep), None)
    except (OSError, UnicodeDecodeError, csv.Error):
        return None
    return names if names and len(set(names)) == len(names) and all(names) else None


def _read_text(source: DataSource, endpoint: str) -> str:
    if source.remote:
        import fsspec

        try:
            with fsspec.open(source.path, "rb", **storage_options(endpoint)) as handle:
                raw = handle.read()
        except Exception as err:
            raise _read_error(source, Location("text"), err) from None
    else:
        local = Path(source.path).expanduser()
        if not local.is_file():
            raise ConfigError(source.key, f"no such file: {local}")
        raw = local.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            source.key, f"cannot read {source.path} as UTF-8 text (byte {err.start}): {err.reason}"
        ) from None


def _read_error(source: DataSource, location: Location, err: BaseException) -> ConfigError:
    cause = err.__cause__ or err.__context__ if type(err).__name__ == "DatasetGenerationError" else err
    reason = f"{type(cause).__name__}: {cause}" if cause is not None else str(err)
    reason = reason.strip().splitlines()[0] if reason.strip() else type(err).__name__
    name = type(err).__name__
    if source.remote and ("NoCredentials" in name or "NoCredentials" in reason):
        return ConfigError(
            source.key,
            f"no AWS credentials to read {source.path}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE) in the environment of every node",
        )
    if location.kind == "hub":
        return ConfigError(
            source.key,
            f"{source.path!r} is not a local file or directory, and loading it as a hub dataset id failed "
            f"({reason}); where no hub is reachable, download it elsewhere "
            f"(huggingface-cli download --repo-type dataset {source.path} --local-dir DIR), copy DIR to the "
            "cluster's shared dir and set the path to DIR",
        )
    if location.kind == "saved" and source.remote and isinstance(err, FileNotFoundError):
        return ConfigError(
            source.key,
            f"{source.path} is neither a data file (name it .jsonl, .json, .csv, .parquet, .arrow or .txt) "
            f"nor a save_to_disk directory ({reason})",
        )
    what = {
        "files": f"{location.builder} records",
        "saved": "a save_to_disk directory",
        "folder": "a directory of data files (json, jsonl, csv, parquet, arrow)",
        "text": "text",
    }[location.kind]
    return ConfigError(source.key, f"cannot read {source.path} as {what}: {reason}")


def _map_columns(records: Any, source: DataSource) -> Any:
    if not source.columns:
        return records
    if isinstance(records, list):  # parsed by us: each record's fields renamed
        present = list(dict.fromkeys(name for record in records for name in record))
        _check_columns_present(source, present)
        return [
            {ours: record.get(theirs) for ours, theirs in source.columns.items()}
            | {name: value for name, value in record.items() if name not in source.columns.values()
               and name not in source.columns}
            for record in records
        ]  # fmt: skip
    present = records.column_names
    _check_columns_present(source, present)
    # The mapping says which column is meant: one already called that is the other, unused one.
    shadowed = [ours for ours in source.columns if ours in present and ours not in source.columns.values()]
    if shadowed:
        records = records.remove_columns(shadowed)
    return records.rename_columns({theirs: ours for ours, theirs in source.columns.items() if ours != theirs})


def _check_columns_present(source: DataSource, present: list[str]) -> None:
    for ours, theirs in source.columns.items():
        if theirs not in present:
            raise ConfigError(
                f"{source.section}.columns",
                f"{source.path} has no column {theirs!r} to read as {ours!r} (its columns: "
                f"{', '.join(present)}); name one of them",
            )


# --- fingerprints ---------------------------------------------------------------------------------


def content_fingerprint(source: DataSource, endpoint: str = "") -> dict[str, Any]:
    """What the bytes of a source are: a sha256 of a local file or directory, ETags and sizes of
    s3 objects, a hub dataset's revision. ConfigError as `read` for a source that cannot be read."""
    location = locate(source, endpoint)
    if location.kind == "bundled":
        return {"sha256": content_hash(bundled_text())}
    if source.remote:
        return _s3_fingerprint(source, endpoint)
    if location.kind == "hub":
        return _hub_fingerprint(source)
    local = Path(source.path).expanduser()
    if local.is_file():
        return {"sha256": file_hash(local)}
    files = (
        sorted(p for p in local.rglob("*") if p.is_file() and not _hidden(p.relative_to(local)))
        if local.is_dir()
        else sorted(p for p in local.parent.glob(local.name) if p.is_file())
    )
    base = local if local.is_dir() else local.parent
    return {
        "sha256": content_hash(*(part for p in files for part in (str(p.relative_to(base)), file_hash(p)))),
        "files": len(files),
    }


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _s3_fingerprint(source: DataSource, endpoint: str) -> dict[str, Any]:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(source.path, **storage_options(endpoint))
        fs.invalidate_cache()  # s3fs keeps listings per process: an object rewritten since must show
        if any(c in path for c in "*?["):
            found = fs.glob(path, detail=True)
        elif fs.isdir(path):
            found = fs.find(path, detail=True)
        else:
            found = {path: fs.info(path)}
    except Exception as err:
        raise _read_error(source, Location("files" if _suffix(source.path) else "saved", "s3"), err) from None
    objects = [
        (name, str(info.get("ETag", "")).strip('"'), int(info.get("size") or 0))
        for name, info in sorted(found.items())
        if info.get("type") != "directory"
    ]
    if not objects:
        raise ConfigError(source.key, f"{source.path}: no such object or prefix")
    return {"etag_sha256": content_hash(json.dumps(objects)), "objects": len(objects)}


def _hub_fingerprint(source: DataSource) -> dict[str, Any]:
    try:
        from huggingface_hub import HfApi

        return {"revision": HfApi().dataset_info(source.path).sha}
    except Exception as err:
        raise _read_error(source, Location("hub"), err) from None


def template_fingerprint(setting: str) -> dict[str, str]:
    """data.chat_template by name, or a Jinja file's path and content hash."""
    if setting in NAMED_TEMPLATES:
        return {"name": setting}
    path = Path(setting).expanduser()
    return {"path": setting, "sha256": file_hash(path) if path.is_file() else "missing"}


def data_fingerprint(config: TrainerConfig) -> dict[str, Any]:
    """Every input the prepared data depends on except the tokenizer (key that with the tokenizer's own
    identity): each source's path, settings and content fingerprint, the eval source, the format, the
    chat template, train_on_inputs, the lengths, packing and the seed (weights below 1 and the eval
    fraction draw with it). Plain JSON-able data, the same on every node for the same data."""
    data = config.data
    endpoint = data.s3_endpoint_url

    def described(source: DataSource) -> dict[str, Any]:
        return {
            "path": source.path or "the bundled text",
            "format": source.format,
            "weight": source.weight,
            "columns": dict(sorted(source.columns.items())),
            "split": source.split,
            "content": content_fingerprint(source, endpoint),
        }

    evaluated = eval_source(data, data.format)
    return {
        "sources": [described(source) for source in data_sources(data)],
        "eval": described(evaluated) if evaluated else None,
        "eval_fraction": data.eval_fraction,
        "format": data.format,
        "chat_template": template_fingerprint(data.chat_template),
        "train_on_inputs": data.train_on_inputs,
        "overlong": data.overlong,
        "packing": data.packing,
        "max_length": config.model.max_length,
        "seed": config.train.seed,
        "s3_endpoint_url": endpoint,
    }


def data_identity(data: DataConfig) -> dict[str, Any]:
    """What a checkpoint records of its training data (checkpoint.IDENTITY_KEYS): one local file (or the
    bundled text) by its content hash, as before several sources existed; several sources, directories,
    s3 objects and hub revisions by a hash of their content fingerprints and weights."""
    sources = data_sources(data)
    contents = [content_fingerprint(source, data.s3_endpoint_url) for source in sources]
    if len(sources) == 1 and sources[0].weight == 1.0 and set(contents[0]) == {"sha256"}:
        return {"path": sources[0].name, "sha256": contents[0]["sha256"]}
    parts = [
        {"path": s.path, "split": s.split, "weight": s.weight, "content": c}
        for s, c in zip(sources, contents, strict=True)
    ]
    return {
        "path": " + ".join(source.name for source in sources),
        "sha256": content_hash(json.dumps(parts, sort_keys=True)),
    }
