"""train.lr_schedule (cosine, linear, constant) after a warmup, and the minimum relative to the learning
rate: the rates a real run used, read from its metrics.jsonl."""

from __future__ import annotations

import itertools
import math

import pytest

from trainer import exitcodes
from trainer.cli import main
from trainer.node.config import load_config
from trainer.node.optim import lr_multiplier

PEAK = 0.01
#: 10 steps with 2 of warmup, one process, every step logged.
SHORT = [
    "train.max_steps=10",
    "train.warmup_steps=2",
    f"train.learning_rate={PEAK}",
    "train.log_every=1",
    "model.n_layer=1",
    "train.micro_batch_size=4",
]


def _rates(run) -> list[float]:
    assert run.returncode == 0, run.stderr[-3000:]
    # The rate logged at step s is the one the next step uses (the scheduler has stepped s times).
    return [record["lr"] for record in run.metrics]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_each_schedule_warms_up_then_follows_its_shape(run_trainer, schedule):
    rates = _rates(run_trainer(*SHORT, f"train.lr_schedule={schedule}", launcher="none"))
    assert len(rates) == 10
    # Warmup over 2 steps: steps 1, 2 and 3 train at 1/3, 2/3 and all of the peak, whatever the schedule.
    assert rates[0] == pytest.approx(PEAK * 2 / 3)
    assert rates[1] == pytest.approx(PEAK)
    after = rates[1:]
    if schedule == "constant":
        assert after == pytest.approx([PEAK] * 9)
        return
    floor = PEAK * 0.1  # min_lr_ratio's default: no min_lr given
    assert after[-1] == pytest.approx(floor)
    drops = [a - b for a, b in itertools.pairwise(after)]
    assert all(drop > 0 for drop in drops)
    if schedule == "linear":
        assert drops == pytest.approx([(PEAK - floor) / 8] * 8)
    else:  # a half cosine: slow, fast, slow; halfway down at the middle
        assert drops[0] < drops[3] > drops[-1]
        assert after[4] == pytest.approx(floor + (PEAK - floor) / 2)


@pytest.mark.slow
def test_an_absolute_min_lr_is_where_the_decay_ends(run_trainer):
    rates = _rates(run_trainer(*SHORT, "train.lr_schedule=linear", "train.min_lr=0.004", launcher="none"))
    assert rates[-1] == pytest.approx(0.004)


def test_a_learning_rate_alone_is_a_whole_schedule(tmp_path, capsys):
    # Before: refused, because the default min_lr (3e-4, the tiny model's) was above it.
    path = tmp_path / "lora.yaml"
    path.write_text("train:\n  learning_rate: 2e-4\n")
    assert main(["train", str(path), "--dry-run"]) == exitcodes.OK
    out = capsys.readouterr().out
    assert "learning_rate: 0.0002\n" in out and "min_lr: null\n  min_lr_ratio: 0.1\n" in out
    assert load_config(path).train.floor_lr() == pytest.approx(2e-5)


def test_a_min_lr_above_the_learning_rate_names_the_way_out(capsys):
    assert main(["train", "--dry-run", "--set", "train.min_lr=0.5"]) == exitcodes.CONFIG_ERROR
    assert "or null for train.min_lr_ratio × learning_rate" in capsys.readouterr().err


def test_the_tiny_gpts_default_schedule_is_unchanged():
    # The schedule before lr_schedule existed: cosine from 3e-3 to min_lr 3e-4 over 80 steps, 10 warmup.
    def before(step: int) -> float:
        if step < 10:
            return (step + 1) / 11
        floor = 3e-4 / 3e-3
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 10) / 70)))

    config = load_config(None).train
    assert [lr_multiplier(step, config) for step in range(81)] == pytest.approx(
        [before(step) for step in range(81)], rel=1e-12
    )
