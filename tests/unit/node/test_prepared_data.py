"""Fine-tuning data prepared once and reused (trainer.node.hf.prepared): what the cache is keyed by, a
second run reusing the first one's preparation with the same arrays, notes, facts and identity, entries
a crash left half-written never used, a directory another account could write refused, and, with real
processes as torchrun starts them, one preparer per file system, the others waiting for it, a bad
record stopping every rank at once, a dead preparer taken over.

The tokenizer, model and data are the tiny ones scripts/build_tiny_hf_model.py builds offline.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from helpers.finetune_harness import build, chat_data, hf_cache, tiny_model  # noqa: F401
from helpers.prepared_harness import digest, result, spawn

from trainer.configerror import ConfigError
from trainer.node.config import load_config
from trainer.node.hf import prepared
from trainer.node.hf.batches import Collator, FinetuneBatches
from trainer.node.hf.chat import CHATML_TEMPLATE
from trainer.node.hf.job import FineTune
from trainer.node.hf.model import check_source, load_tokenizer
from trainer.node.order import START


@pytest.fixture(scope="module")
def big_data(hf_cache):  # noqa: F811
    """Enough conversations that preparing them takes seconds on this machine (a preparer can be
    caught in the act)."""
    path = hf_cache / "conversations-6000.json"
    if not path.is_file():
        build("data", str(path), "--samples", "6000")
    return path


def sets_for(model, data, tmp_path, *extra: str) -> list[str]:
    return [f"model.name_or_path={model}", f"data.path={data}", f"output_dir={tmp_path / 'out'}", *extra]


def key_of(sets: list[str]) -> str:
    config = load_config(None, sets)
    tokenizer = load_tokenizer(config.model, check_source(config.model.name_or_path))
    return prepared.cache_key(config, tokenizer)[0]


def test_the_key_changes_with_every_input_and_only_with_them(tiny_model, hf_cache, tmp_path):  # noqa: F811
    data = tmp_path / "chat.jsonl"
    build("data", str(data), "--samples", "50", "--jsonl")
    eval_file = tmp_path / "eval.jsonl"
    build("data", str(eval_file), "--samples", "10", "--jsonl", "--seed", "3")
    other_tokenizer = hf_cache / "no-template"
    if not (other_tokenizer / "config.json").is_file():
        build("model", str(other_tokenizer), "--no-chat-template")
    base = sets_for(tiny_model, data, tmp_path, "data.eval_fraction=0.1")
    key = key_of(base)
    changed = {
        "format": [*base, "data.format=conversations"],
        "packing": [*base, "data.packing=true"],
        "overlong": [*base, "data.overlong=drop"],
        "eval fraction": [*base, "data.eval_fraction=0.2"],
        "eval file": [*sets_for(tiny_model, data, tmp_path), f"data.eval_path={eval_file}"],
        "max length": [*base, "model.max_length=256"],
        "seed of the split": [*base, "train.seed=7"],
        "tokenizer": sets_for(other_tokenizer, data, tmp_path, "data.eval_fraction=0.1"),
    }
    keys = {what: key_of(sets) for what, sets in changed.items()}
    assert key not in keys.values() and len(set(keys.values())) == len(keys), keys
    same = [
        *base,
        "train.max_steps=3",
        "data.repeats=4",
        "model.dtype=fp32",
        f"data.prepared_dir={tmp_path}/x",
    ]
    assert key_of([*same, f"output_dir={tmp_path / 'elsewhere'}"]) == key, "training settings are not inputs"
    # The data's content, not its name: one byte more in the file (or in the eval file) is another key.
    eval_key = keys["eval file"]
    with open(eval_file, "a") as handle:
        handle.write("\n")
    assert key_of(changed["eval file"]) != eval_key
    with open(data, "a") as handle:
        handle.write("\n")
    assert key_of(base) != key


def test_a_second_run_reuses_the_preparation_with_the_same_data(tiny_model, chat_data, tmp_path):  # noqa: F811
    sets = sets_for(tiny_model, chat_data, tmp_path, "data.packing=true", "data.eval_fraction=0.1")
    first = FineTune.prepare(load_config(None, sets), world_size=1)
    entry = tmp_path / "out" / "prepared-data"
    assert first.notes[-1].startswith(f"data: prepared {entry}/")
    second = FineTune.prepare(load_config(None, sets), world_size=1)
    assert second.notes[-1].startswith(f"data: reused prepared data {entry}/")
    assert f" by {os.uname().nodename} rank 0)" in second.notes[-1]
    alone = FineTune.prepare(load_config(None, [*sets, "data.prepare_once=false"]), world_size=1)
    assert not any("prepared" in note for note in alone.notes)
    for job in (first, second):
        assert digest(job) == digest(alone)
        assert job.facts == alone.facts, "run.json's data section is the same"
        assert job.identity == alone.identity, "the checkpoint identity is the same"
        assert job.notes[:-1] == alone.notes, "the log says what was read, truncated, packed, as before"
    assert not second.train.ids.flags.writeable, "memory-mapped, read-only"


def test_memory_mapped_samples_make_the_same_batches(tiny_model, chat_data, tmp_path):  # noqa: F811
    sets = sets_for(tiny_model, chat_data, tmp_path, "data.packing=true")
    FineTune.prepare(load_config(None, sets), world_size=1)
    mapped = FineTune.prepare(load_config(None, sets), world_size=1)
    in_memory = FineTune.prepare(load_config(None, [*sets, "data.prepare_once=false"]), world_size=1)

    def steps(job) -> list:
        collator = Collator(job.train, job.rows, pad_id=0, reset_positions=True, device="cpu")
        batches = FinetuneBatches(collator, repeats=1, micro_batch_size=4, rank=1, world_size=2, seed=5)
        batches.start(START, 2)
        return [batch for step in (1, 2, 3) for batch in batches.micro_batches(step)]

    for (ids, labels, positions, count), (ids2, labels2, positions2, count2) in zip(
        steps(mapped), steps(in_memory), strict=True
    ):
        assert ids.equal(ids2) and labels.equal(labels2) and positions.equal(positions2) and count == count2


def test_the_chat_template_the_preparation_chose_is_kept_on_reuse(hf_cache, chat_data, tmp_path):  # noqa: F811
    model = hf_cache / "no-template"
    if not (model / "config.json").is_file():
        build("model", str(model), "--no-chat-template")
    sets = sets_for(model, chat_data, tmp_path)
    first = FineTune.prepare(load_config(None, sets), world_size=1)
    second = FineTune.prepare(load_config(None, sets), world_size=1)
    assert "reused" in second.notes[-1]
    # The final model's tokenizer is saved with it: the same template whether prepared or reused.
    assert first.tokenizer.chat_template == second.tokenizer.chat_template == CHATML_TEMPLATE


def entry_dir(tmp_path):
    [entry] = [p for p in (tmp_path / "out" / "prepared-data").iterdir() if "." not in p.name]
    return entry


@pytest.mark.parametrize(
    "damage",
    ["no done marker", "truncated array", "array of another length", "meta.json cut short"],
)
def test_a_half_written_or_damaged_entry_is_never_used(tiny_model, chat_data, tmp_path, damage):  # noqa: F811
    sets = sets_for(tiny_model, chat_data, tmp_path)
    good = digest(FineTune.prepare(load_config(None, sets), world_size=1))
    entry = entry_dir(tmp_path)
    # Each damaged file is a new file: the one this process has memory-mapped stays as it was.
    if damage == "no done marker":
        (entry / "done").unlink()
    elif damage == "truncated array":
        raw = (entry / "train_ids.npy").read_bytes()
        (entry / "train_ids.npy").unlink()
        (entry / "train_ids.npy").write_bytes(raw[: len(raw) // 2])
    elif damage == "array of another length":
        (entry / "train_labels.npy").unlink()
        np.save(entry / "train_labels.npy", np.zeros(7, np.int32))
    else:
        (entry / "meta.json").write_text((entry / "meta.json").read_text()[:100])
    again = FineTune.prepare(load_config(None, sets), world_size=1)
    assert again.notes[-1].startswith("data: prepared "), "prepared anew, not reused"
    assert digest(again) == good
    assert FineTune.prepare(load_config(None, sets), world_size=1).notes[-1].startswith("data: reused")


def test_a_crashed_preparers_leftovers_are_ignored_and_cleared(tiny_model, chat_data, tmp_path):  # noqa: F811
    sets = sets_for(tiny_model, chat_data, tmp_path)
    config = load_config(None, sets)
    key = key_of(sets)
    cache = tmp_path / "out" / "prepared-data"
    cache.mkdir(parents=True, mode=0o750)
    # What a preparer killed while writing leaves: its partial copy, never renamed into place.
    partial = cache / f"{key}.tmp-deadbeef"
    partial.mkdir(mode=0o750)
    (partial / "train_ids.npy").write_bytes(b"\x93NUMPY")
    job = FineTune.prepare(config, world_size=1)
    assert job.notes[-1].startswith("data: prepared ")
    assert sorted(p.name for p in cache.iterdir()) == [key]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the directory to another account needs root")
def test_a_cache_another_account_owns_is_refused(tiny_model, chat_data, tmp_path):  # noqa: F811
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ConfigError) as refused:
        FineTune.prepare(
            load_config(None, sets_for(tiny_model, chat_data, tmp_path, f"data.prepared_dir={theirs}")), 1
        )
    assert refused.value.key == "data.prepared_dir" and "belongs to uid 65534" in refused.value.problem


def test_a_cache_others_can_write_is_refused(tiny_model, chat_data, tmp_path):  # noqa: F811
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    sets = sets_for(tiny_model, chat_data, tmp_path, f"data.prepared_dir={open_dir}")
    with pytest.raises(ConfigError) as refused:
        FineTune.prepare(load_config(None, sets), 1)
    assert "writable by others (mode 0777)" in str(refused.value) and "chmod go-w" in str(refused.value)
    open_dir.chmod(0o750)
    assert FineTune.prepare(load_config(None, sets), 1).notes[-1].startswith("data: prepared ")


# --- several processes, as torchrun starts them --------------------------------------------------


def test_one_process_prepares_and_the_others_wait_for_it(tiny_model, big_data, tmp_path):  # noqa: F811
    sets = sets_for(tiny_model, big_data, tmp_path, "data.packing=true")
    cache = tmp_path / "cache"
    # Two "nodes" of two processes on one file system; the waiters start first. Rank 2, the second
    # node's local rank 0, would prepare itself after its grace with nothing in the cache (the case of
    # a node that does not share the directory, tested below with a grace of 1 s): here it is longer
    # than this test, as 5 s was not at load 14 in CI, where rank 0's start (torch's import) lagged
    # rank 2's by more and rank 2 prepared.
    waiters = [spawn(sets, cache, rank=r, local_rank=r % 2, grace=600) for r in (3, 2, 1)]
    time.sleep(1)
    preparer = spawn(sets, cache, rank=0, local_rank=0)
    results = [result(p) for p in [preparer, *waiters]]
    prepared_lines = [r for r in results if r["note"].startswith("data: prepared ")]
    assert len(prepared_lines) == 1, [r["note"] for r in results]
    assert "reused prepared data" in results[1]["note"] and results[1]["note"].endswith(" rank 0)")
    assert len({r["digest"] for r in results}) == 1
    # Waiting costs next to nothing: the waiters' CPU seconds together are a fraction of one preparation.
    assert sum(r["cpu_seconds"] for r in results[1:]) < 0.5 * results[0]["cpu_seconds"], results


def test_a_bad_record_stops_every_rank_at_once_with_the_same_error(tiny_model, tmp_path):  # noqa: F811
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"conversations": [{"from": "wizard", "value": "hi"}]}]))
    sets = sets_for(tiny_model, bad, tmp_path)
    cache = tmp_path / "cache"
    processes = [spawn(sets, cache, rank=r, local_rank=r % 2, no_preparer=300) for r in range(4)]
    results = [result(p) for p in processes]
    assert {r["returncode"] for r in results} == {2}
    assert len({r["error"] for r in results}) == 1 and "wizard" in results[0]["error"], results
    assert all(r["kind"] == "ConfigError" for r in results)
    assert max(r["seconds"] for r in results) < 60, "at once, not after a timeout"
    # A later job tries again (the data may have been fixed meanwhile), and is told the same.
    again = result(spawn(sets, cache, rank=0, local_rank=0, job="job-2"))
    assert again["error"] == results[0]["error"]


def wait_for_lock(cache, timeout=120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for owner in cache.glob("*.lock/owner.json"):
            try:
                return json.loads(owner.read_text())
            except (OSError, ValueError):
                pass
        time.sleep(0.05)
    raise AssertionError("no preparer took the lock")


@pytest.mark.parametrize("death", ["killed", "frozen"])
def test_a_dead_preparer_is_taken_over(tiny_model, big_data, tmp_path, death):  # noqa: F811
    """killed: its pid is gone (this host); frozen (SIGSTOP): its pid lives but its heartbeat stops,
    which is how a preparer on a lost node looks from the others."""
    sets = sets_for(tiny_model, big_data, tmp_path)
    cache = tmp_path / "cache"
    timing = {"stale": 3.0, "heartbeat": 0.5}
    preparer = spawn(sets, cache, rank=0, local_rank=0, **timing)
    owner = wait_for_lock(cache)
    os.kill(preparer.pid, signal.SIGKILL if death == "killed" else signal.SIGSTOP)
    if death == "killed":
        preparer.wait()  # reaped, as torchrun reaps its workers
    waiter = spawn(sets, cache, rank=1, local_rank=1, **timing)
    try:
        took_over = result(waiter)
    finally:
        if death == "frozen":
            os.kill(preparer.pid, signal.SIGCONT)
    assert took_over["note"].startswith("data: prepared "), took_over
    why = f"pid {owner['pid']} no longer runs" if death == "killed" else "gave no heartbeat for"
    assert f"took over preparing {cache}/" in took_over["stderr"] and why in took_over["stderr"]
    if death == "frozen":  # woken up, the old preparer finds the entry done and uses it
        late = result(preparer)
        assert late["digest"] == took_over["digest"] and "reused" in late["note"], late
    assert [p.name for p in cache.iterdir()] == [took_over["note"].split("/")[-1].split()[0]]


def test_nodes_without_a_shared_dir_each_prepare_their_own(tiny_model, chat_data, tmp_path):  # noqa: F811
    """Each node's local rank 0 prepares in the directory of the same name on its own disk (two
    directories here); its other processes wait for it."""
    sets = sets_for(tiny_model, chat_data, tmp_path)
    node0, node1 = tmp_path / "node0-disk", tmp_path / "node1-disk"
    processes = [
        spawn(sets, node0, rank=0, local_rank=0, grace=1),
        spawn(sets, node0, rank=1, local_rank=1, grace=1),
        spawn(sets, node1, rank=2, local_rank=0, grace=1),
        spawn(sets, node1, rank=3, local_rank=1, grace=1),
    ]
    results = [result(p) for p in processes]
    assert [r["note"].split()[1] for r in results] == ["prepared", "reused", "prepared", "reused"]
    assert "by " in results[3]["note"] and " rank 2)" in results[3]["note"]
    assert len({r["digest"] for r in results}) == 1
