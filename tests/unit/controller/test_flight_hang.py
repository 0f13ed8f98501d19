"""The stall's culprit by torch's flight recorder, as the launcher reads the bundled trainer's progress
records (hang.flight_hang, behind_hang's detail; issue 39): the counts each rank's record holds are
untrusted (the training account writes them), so a record of the wrong shape names nobody. The counts
themselves come from real gloo ranks in tests/unit/node/test_flight_recorder.py. And run.sh's lines
that turn the recorder on for every command."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

from trainer.controller.launcher.hang import RankState, behind_hang, flight_hang
from trainer.controller.launcher.runscript import flight_recorder_lines
from trainer.run_paths import RunPaths

STATES = [RankState("n0", 0, 0, 10, "S"), RankState("n1", 1, 1, 11, "S"), RankState("n2", 2, 2, 12, "S")]


def entered(seq: int, ended: int, op: str = "all_reduce", group: str = "default_pg") -> dict:
    return {"collectives": {"0": {"group": group, "entered": seq, "ended": ended, "op": op}}}


def test_the_rank_in_another_collective_than_most_is_named():
    records = {
        ("n0", 0): entered(9, 8),
        ("n1", 1): entered(9, 8, "broadcast"),
        ("n2", 2): entered(9, 8),
    }
    hang = flight_hang(STATES, records)
    assert hang is not None and hang.culprit.rank == 1 and hang.diverged, hang
    assert hang.culprit_text == (
        "in another collective than its peers: broadcast #9, while they wait in all_reduce #9 — sleeping — "
        "state S"
    )


def test_every_rank_waiting_in_the_same_collective_names_nobody():
    records = {key: entered(9, 8) for key in (("n0", 0), ("n1", 1), ("n2", 2))}
    assert flight_hang(STATES, records) is None, "a collective that never ends: a lost peer, a partition"
    two_ways = {("n0", 0): entered(9, 8), ("n1", 1): entered(9, 8, "broadcast")}
    assert flight_hang(STATES[:2], two_ways) is None, "two ranks, one in each: either may have gone astray"


def test_a_group_other_than_the_default_is_named_in_the_text():
    records = {("n0", 0): entered(5, 4, group="3"), ("n1", 1): entered(4, 4, group="3"), ("n2", 2): {}}
    hang = flight_hang(STATES, records)
    assert hang is not None and hang.culprit.rank == 1, hang
    assert hang.waited_in == "all_reduce #5 of group 3"
    assert hang.consequence_text(STATES[2]) == "waiting in its collective (sleeping — state S)", "no record"


def test_records_of_the_wrong_shape_name_nobody():
    for bad in (
        {"collectives": "0"},
        {"collectives": {"0": {"entered": "9", "ended": 8}}},
        {"collectives": {"0": {"entered": True, "ended": 8}}},
        {"collectives": {"0": None}},
        ["not", "a", "record"],
    ):
        records = {("n0", 0): entered(9, 8), ("n1", 1): bad, ("n2", 2): entered(9, 8)}
        assert flight_hang(STATES, records) is None, bad


def test_the_rank_behind_by_its_step_also_says_its_last_collective():
    records = {("n0", 0): entered(12, 11), ("n1", 1): entered(11, 11), ("n2", 2): entered(12, 11)}
    hang = behind_hang(STATES, [("n1", 1, 5)], 6, records)
    assert hang is not None and hang.culprit.rank == 1
    assert hang.culprit_text == (
        "behind its peers: in step 5 while they are in step 6 — sleeping — state S; its last collective: "
        "all_reduce #11, ended"
    )
    assert hang.consequence_text(STATES[0]) == "waiting in all_reduce #12 (sleeping — state S)"
    assert behind_hang(STATES, [("n1", 1, 5)], 6).culprit_text.endswith("— sleeping — state S"), "no records"


def recorder_env(tmp_path: Path, **given: str) -> dict[str, str]:
    """What run.sh's recorder lines export, run by bash with `given` already in the environment (the
    training_env exports come first in run.sh)."""
    plan = SimpleNamespace(paths=RunPaths.of(tmp_path, "r"))
    script = "\n".join([*flight_recorder_lines(plan), "env"])  # type: ignore[arg-type]
    env = {"PATH": os.environ["PATH"], "CLUSTERTRAIN_LAUNCH_ID": "r-1234", **given}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if line.startswith("TORCH_"))


def test_run_sh_turns_the_recorder_on_with_one_dump_dir_per_launch_unless_training_env_says_otherwise(
    tmp_path,
):
    env = recorder_env(tmp_path)
    dumps = tmp_path / "runs" / "r" / "launch" / "flight-recorder" / "r-1234"
    assert env == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": f"{dumps}/rank_",
    }
    assert dumps.is_dir(), "NCCL's dump on a timeout has its dir"
    assert recorder_env(tmp_path, TORCH_FR_BUFFER_SIZE="0")["TORCH_FR_BUFFER_SIZE"] == "0"
