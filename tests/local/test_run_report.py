"""The run report: PNG curves beside metrics.jsonl, drawn by rank 0 at the end of a real run (2 "nodes"
on loopback, so the step time has a line per node), redrawn by `trainer report RUN_DIR`; a fine-tuning
run's eval loss goes on the loss picture and to the trackers through the same reporter."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers.finetune_harness import chat_data, finetune_sets, hf_cache, tiny_model  # noqa: F401
from helpers.trainer_harness import BIN, TIMEOUT_S, TRAINER, free_port, sets, trainer_env

from trainer.node.report import curves, figure, read_metrics

PICTURES = ["loss.png", "learning_rate.png", "tokens_per_s.png", "step_time.png"]
STEPS = ["train.max_steps=6", "train.log_every=2", "train.micro_batch_size=8", "checkpoint.save_steps=0"]


@pytest.fixture(scope="module")
def two_node_run(tmp_path_factory):
    """Two torchrun "nodes" of one process each, c10d rendezvous on loopback."""
    tmp_path = tmp_path_factory.mktemp("report")
    output_dir = tmp_path / "run"
    port = free_port()
    jobs = [
        subprocess.Popen(
            [
                str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "1",
                "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "report",
                TRAINER, "train", *sets(f"output_dir={output_dir}", *STEPS),
            ],
            cwd=tmp_path, env=trainer_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for node in (0, 1)
    ]  # fmt: skip
    try:
        outputs = [job.communicate(timeout=TIMEOUT_S) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    assert [job.returncode for job in jobs] == [0, 0], "".join(err for _, err in outputs)[-4000:]
    return output_dir, "".join(out for out, _ in outputs)


def series(records, key, scale=1.0):
    return [r["step"] for r in records if key in r], [r[key] * scale for r in records if key in r]


def node_series(records, node):
    return [r["step"] for r in records], [r["step_time_s_by_node"][node] * 1000 for r in records]


def test_the_end_of_a_run_draws_non_blank_pngs_whose_ranges_match_the_metrics(two_node_run):
    from matplotlib.image import imread

    output_dir, stdout = two_node_run
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 4, 6]
    assert f"report: {', '.join(PICTURES)} in {output_dir}" in stdout
    for name in PICTURES:
        pixels = imread(output_dir / name)
        assert pixels.shape[:2] == (450, 800), name
        assert pixels[..., :3].std() > 0.05, f"{name} is blank"
    report = json.loads((output_dir / "report.json").read_text())
    assert report["records"] == 4 and sorted(report["pictures"]) == sorted(PICTURES)
    want = {
        ("loss.png", "train loss"): series(records, "loss"),
        ("learning_rate.png", "lr"): series(records, "lr"),
        ("tokens_per_s.png", "tokens/s"): series(records, "tokens_per_s"),
        ("step_time.png", "node0"): node_series(records, "node0"),
        ("step_time.png", "node1"): node_series(records, "node1"),
    }
    for (picture, label), (steps, values) in want.items():
        line = report["pictures"][picture]["lines"][label]
        assert line["points"] == len(steps)
        assert line["steps"] == [min(steps), max(steps)]
        assert line["values"] == pytest.approx([min(values), max(values)])
    assert sorted(report["pictures"]["step_time.png"]["lines"]) == ["node0", "node1"]


def test_each_figure_plots_the_metrics_series_inside_its_axes(two_node_run):
    output_dir, _ = two_node_run
    records = read_metrics(output_dir)
    drawn = {}
    for curve in curves(records):
        axes = figure(curve, "run").axes[0]
        low, high = axes.get_ylim()
        for line in axes.lines:
            steps, values = list(line.get_xdata()), list(line.get_ydata())
            drawn[(curve.file, line.get_label())] = (steps, values)
            assert low <= min(values) and max(values) <= high, (curve.file, line.get_label())
        assert axes.get_xlabel() == "step"
    assert drawn[("loss.png", "train loss")] == series(records, "loss")
    assert drawn[("tokens_per_s.png", "tokens/s")] == series(records, "tokens_per_s")
    assert drawn[("step_time.png", "node1")] == node_series(records, "node1")
    assert len(drawn) == 5  # loss, lr, tokens/s, and the step time of each node


def test_trainer_report_redraws_a_run_and_refuses_a_dir_without_metrics(two_node_run, tmp_path):
    output_dir, _ = two_node_run
    copy = tmp_path / "copy"
    copy.mkdir()
    # A run killed while writing its last line: the report draws what is whole.
    shutil.copy(output_dir / "metrics.jsonl", copy / "metrics.jsonl")
    with open(copy / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 8, "loss": 3.')
    done = subprocess.run([TRAINER, "report", str(copy)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    files = [*PICTURES, "report.json", "report.html"]
    assert done.stdout.splitlines() == [str(copy / name) for name in files]
    assert json.loads((copy / "report.json").read_text()) == json.loads(
        (output_dir / "report.json").read_text()
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    done = subprocess.run([TRAINER, "report", str(empty)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"trainer report: {empty} has no metrics.jsonl" in done.stderr
    assert list(empty.iterdir()) == []
    # Without matplotlib (blocked in a fresh interpreter, as if not installed): the fix, exit 2.
    blocked = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from trainer.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", blocked, "report", str(copy)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert (
        "trainer report: needs matplotlib, which is not installed here: pip install matplotlib" in done.stderr
    )


def test_fine_tuning_reports_its_eval_loss_through_the_same_reporter(tiny_model, chat_data, tmp_path):  # noqa: F811
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    output_dir = tmp_path / "ft"
    overrides = finetune_sets(
        tiny_model,
        chat_data,
        "train.max_steps=4",
        "train.log_every=2",
        "checkpoint.save_steps=0",
        "data.eval_fraction=0.1",
        "eval.every_steps=2",
        "metrics.report_to=tensorboard",
    )
    done = subprocess.run(
        [TRAINER, "train", *sets(f"output_dir={output_dir}", *overrides)],
        capture_output=True, text=True, env=trainer_env(), timeout=TIMEOUT_S, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    records = read_metrics(output_dir)
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    assert [step for step, _ in evals] == [2, 4]
    accumulator = EventAccumulator(str(output_dir / "tensorboard"))
    accumulator.Reload()
    got = [(e.step, e.value) for e in accumulator.Scalars("eval/loss")]
    assert [s for s, _ in got] == [2, 4]
    assert [v for _, v in got] == pytest.approx([v for _, v in evals], rel=1e-6)
    report = json.loads((output_dir / "report.json").read_text())
    line = report["pictures"]["loss.png"]["lines"]["eval loss"]
    assert line["steps"] == [2, 4]
    assert line["values"] == pytest.approx(sorted(v for _, v in evals))
