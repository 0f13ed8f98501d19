"""metrics.report_to: a real 2-process run of the tiny GPT sends its logged steps to TensorBoard, W&B
(offline) and MLflow (a file store in the run dir), read back here with each tool's own reader; rank 0
alone writes them; a tracker whose package is missing is refused by name before anything is created."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.trainer_harness import TRAINER, sets, trainer_env

STEPS = ["train.max_steps=6", "train.log_every=2", "train.micro_batch_size=8", "checkpoint.save_steps=0"]
SECRET = "hook-token-5f1e"
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "train/step_time_s",
}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    from helpers.trainer_harness import finish, start_run

    output_dir = tmp_path_factory.mktemp("report_to") / "run"
    # A secret, never sent to a tracker; in a --config file (a node refuses it in --set).
    webhook_config = output_dir.parent / "webhook.yaml"
    webhook_config.write_text(f"health:\n  webhook_url: http://127.0.0.1:9/{SECRET}\n")
    run = finish(
        start_run(
            output_dir,
            [
                *STEPS,
                "metrics.report_to=tensorboard,wandb,mlflow",
                "metrics.project=tracked",
            ],
            env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": ""},
            config=webhook_config,
        ),
        output_dir,
    )
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert "WARNING trainer.node.metrics" not in run.stderr, run.stderr[-4000:]  # no tracker gave up
    steps = [line.split(" loss ")[0] for line in run.stdout.splitlines() if line.startswith("step ")]
    assert steps == ["step 1/6", "step 2/6", "step 4/6", "step 6/6"]  # the launcher's lines, unwrapped
    for where in (f"tensorboard writes to {output_dir}/tensorboard", f"wandb writes to {output_dir}/wandb/"):
        assert f"rank 0 INFO trainer.node.metrics: metrics.report_to: {where}" in run.stderr
    assert f"mlflow writes to {(output_dir / 'mlruns').as_uri()} (experiment 'tracked'" in run.stderr
    return run


def expected(run, key: str) -> list[tuple[int, float]]:
    return [(m["step"], m[key]) for m in run.metrics]


def close_enough(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    """Same steps, same values (TensorBoard stores float32)."""
    return [s for s, _ in got] == [s for s, _ in want] and all(
        math.isclose(g, w, rel_tol=1e-6) for (_, g), (_, w) in zip(got, want, strict=True)
    )


def test_tensorboard_events_match_metrics_jsonl(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((tracked_run.output_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1, f"rank 0 alone writes events: {events}"
    accumulator = EventAccumulator(str(events[0].parent), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [m["step"] for m in tracked_run.metrics] == [1, 2, 4, 6]
    for key, tag in TAGS.items():
        got = [(e.step, e.value) for e in accumulator.Scalars(tag)]
        assert close_enough(got, expected(tracked_run, key)), (tag, got)
    node_tags = [t for t in accumulator.Tags()["scalars"] if t.startswith("train/step_time_s_by_node/")]
    assert node_tags == ["train/step_time_s_by_node/node0"]  # one node: loopback
    # The config as hyperparameters (TensorBoard's HParams plugin).
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = accumulator.PluginTagToContent("hparams")
    session = next(
        data.session_start_info
        for data in (plugin_data_pb2.HParamsPluginData.FromString(raw) for raw in content.values())
        if data.HasField("session_start_info")
    )
    assert session.hparams["train.max_steps"].number_value == 6
    assert session.hparams["metrics.report_to"].string_value == "tensorboard,wandb,mlflow"
    assert SECRET not in str(session)


def wandb_records(path: Path):
    """The records of a W&B transaction log (`run-*.wandb`): W&B's header, then LevelDB-log framed
    protobufs (32 KiB blocks of [crc32c, length, type] chunks), parsed with W&B's own protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    block, offset, pending = 32768, 7, b""
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        length, kind = struct.unpack("<HB", data[offset + 4 : offset + 7])
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def test_wandb_offline_run_holds_the_same_scalars_and_the_config(tracked_run):
    runs = list((tracked_run.output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"rank 0 alone makes a W&B run: {runs}"
    history: dict[str, list[tuple[int, float]]] = {}
    config: dict[str, object] = {}
    names = []
    for record in wandb_records(next(runs[0].glob("run-*.wandb"))):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if key in TAGS.values():
                    history.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
        elif kind in ("config", "run"):  # the run record carries the config given to wandb.init
            updates = record.config.update if kind == "config" else record.run.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
            if kind == "run":
                names.append((record.run.project, record.run.display_name))
    for key, tag in TAGS.items():
        assert close_enough(history[tag], expected(tracked_run, key)), (tag, history[tag])
    assert config["train.max_steps"] == 6 and config["distributed.engine"] == "ddp"
    assert SECRET not in json.dumps(config)
    assert ("tracked", "run") in names


def test_mlflow_file_store_holds_the_same_scalars_and_the_config(tracked_run, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tracked_run.output_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("tracked")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "rank 0 alone makes an MLflow run"
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    for key, tag in TAGS.items():
        got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag)]
        assert close_enough(sorted(got), expected(tracked_run, key)), (tag, got)
    node0 = client.get_metric_history(run.info.run_id, "train/step_time_s_by_node/node0")
    assert sorted((m.step, m.value) for m in node0) == [
        (m["step"], m["step_time_s_by_node"]["node0"]) for m in tracked_run.metrics
    ]
    assert run.data.params["train.max_steps"] == "6"
    assert SECRET not in json.dumps(run.data.params) and run.data.params["health.webhook_url"] != ""
    assert len(run.data.params) > 50  # the whole config, not a few keys


# A tracker's package is absent here as on a node without the extra: blocked in a fresh interpreter,
# so `import` fails and importlib.util.find_spec says None (tests/unit/test_package_split.py does the same).
WITHOUT = """
import sys
sys.modules[sys.argv[1]] = None
from trainer.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("tracker", "module", "extra"),
    [("wandb", "wandb", "wandb"), ("mlflow", "mlflow", "mlflow"), ("tensorboard", "tensorboard", "train")],
)
def test_a_missing_tracker_package_is_refused_by_name_before_anything_is_created(
    tmp_path, tracker, module, extra
):
    output_dir = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT, module, "train",
         *sets(f"output_dir={output_dir}", *STEPS, f"metrics.report_to={tracker}")],
        capture_output=True, text=True, env=trainer_env(), timeout=120,
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert "metrics.report_to" in run.stderr and f"pip install 'clustertrain[{extra}]'" in run.stderr
    assert f"{tracker} needs the" in run.stderr
    assert not output_dir.exists(), "nothing is created before the config is refused"


def test_a_tracking_uri_with_a_password_is_refused_without_echoing_it(tmp_path):
    # In a --config file: on the command line `trainer train` refuses any credential before reading it.
    config = tmp_path / "tracking.yaml"
    config.write_text("metrics:\n  tracking_uri: http://bob:hunter2@127.0.0.1:5000\n")
    run = subprocess.run(
        [TRAINER, "train", "--dry-run", "--config", str(config), *sets(f"output_dir={tmp_path / 'out'}")],
        capture_output=True, text=True, env=trainer_env(), timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert "metrics.tracking_uri: holds a password: give MLflow its credentials through" in run.stderr
    assert "hunter2" not in run.stderr + run.stdout


def test_an_unknown_tracker_gets_a_did_you_mean(tmp_path):
    run = subprocess.run(
        [TRAINER, "train", "--dry-run", *sets(f"output_dir={tmp_path}", "metrics.report_to=tensorbord")],
        capture_output=True, text=True, env=trainer_env(), timeout=120,
    )  # fmt: skip
    assert run.returncode == 2
    assert "metrics.report_to: unknown tracker 'tensorbord': did you mean tensorboard?" in run.stderr


def test_a_resumed_run_replaces_the_tensorboard_steps_past_its_checkpoint(run_trainer):
    """Resumed from step 2 of a run that logged to step 4: as metrics.jsonl drops steps 3 and 4 and
    logs them again, TensorBoard shows each step once (two event files, purge_step), not 3 and 4 twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    common = ["train.max_steps=4", "train.log_every=1", "train.micro_batch_size=8", "checkpoint.save_steps=2"]
    first = run_trainer(*common, "metrics.report_to=tensorboard", launcher="none", nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    step_2 = first.output_dir / "checkpoints" / "step-2"
    again = run_trainer(
        *common, "metrics.report_to=tensorboard", f"checkpoint.resume={step_2}", launcher="none", nproc=1
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout
    metrics = again.metrics
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert len(list((again.output_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    accumulator = EventAccumulator(str(again.output_dir / "tensorboard"))
    accumulator.Reload()
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr")):
        got = [(e.step, e.value) for e in accumulator.Scalars(tag)]
        assert close_enough(got, [(m["step"], m[key]) for m in metrics]), (tag, got)
