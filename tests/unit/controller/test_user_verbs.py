"""Every verb's `--help` ends with examples a user can paste, and the live view's step line carries the
trainer's tokens/s and an ETA. (`trainer stop` and `trainer logs` on real runs: test_user_verbs_local.)"""

from __future__ import annotations

import shlex

import pytest

from trainer import cli
from trainer.controller.launcher.live import JobMonitor, LiveView, StepRate, describe, short_duration
from trainer.node.metrics import step_line


@pytest.mark.parametrize("verb", list(cli.COMMANDS))
def test_every_verbs_help_ends_with_examples_that_its_parser_accepts(verb, capsys):
    with pytest.raises(SystemExit) as shown:
        cli.main([verb, "--help"])
    assert shown.value.code == 0
    help_text = capsys.readouterr().out
    assert "\nExamples:\n" in help_text, help_text
    examples = help_text.split("\nExamples:\n", 1)[1].strip().splitlines()
    assert examples, help_text
    module, parser = cli.verb_parser(verb)
    for example in examples:
        words = shlex.split(example, comments=True)
        # `trainer VERB ...`, or the verb under a launcher (`torchrun ... -m trainer train ...`).
        at = next((i for i in range(len(words) - 1) if words[i : i + 2] == ["trainer", verb]), None)
        assert at is not None, f"{example!r} is not a `trainer {verb}` command line"
        given = words[at + 2 :]
        if getattr(module, "TAKES_COMMAND", False) and "--" in given:
            given = given[: given.index("--")]
        parser.parse_args(given)  # exits 2, naming the bad option, if the example went stale


def test_a_wide_help_keeps_the_epilog_text_and_the_examples_on_their_own_lines(capsys):
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    help_text = capsys.readouterr().out
    assert "run your own command on every node" in help_text, "plan.py's epilog is kept, not replaced"
    assert (
        "\n  trainer launch -i inventory/mycluster --run-name first --set train.max_steps=200\n" in help_text
    )


def test_the_step_text_has_tokens_per_second_and_an_eta_from_the_rate_since_the_first_step_seen():
    rate = StepRate()
    # The trainer's own step lines (trainer.node.metrics.step_line, what rank 0 prints), as they arrive.
    first = step_line(10, 200, 3.2, 3e-3, 1180.4, 0.21)
    assert rate.see(first, now=100.0) == "step 10/200 · 1,180 tok/s", "no ETA from one step"
    later = step_line(40, 200, 2.9, 3e-3, 1234.0, 0.2)
    # 30 steps in 30 s; 160 to go.
    assert rate.see(later, now=130.0) == "step 40/200 · 1,234 tok/s · ETA 2m40s"
    assert rate.see(step_line(200, 200, 2.1, 3e-3, 1300.0, 0.2), now=290.0) == "step 200/200 · 1,300 tok/s"


def test_a_burst_of_old_step_lines_does_not_count_as_speed():
    # `trainer attach` gets the last lines at once: the rate counts from the last of that batch.
    rate = StepRate()
    for step in (2, 4, 6, 8):
        rate.see(step_line(step, 1000, 3.0, 1e-3, 900.0, 0.5), now=50.0)
    assert rate.text() == "step 8/1000 · 900 tok/s", "four steps in no time is no rate"
    assert rate.see(step_line(10, 1000, 3.0, 1e-3, 900.0, 0.5), now=51.0).endswith("ETA 8m15s")


def test_a_step_line_of_your_own_command_without_tokens_gets_the_eta_alone():
    rate = StepRate()
    rate.see("step 1/10 loss 2.0", now=0.0)
    assert rate.see("step 3/10 loss 1.5", now=4.0) == "step 3/10 · ETA 14s"


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0.4, "0s"),
        (59.4, "59s"),
        (60, "1m00s"),
        (192, "3m12s"),
        (3599, "59m59s"),
        (3840, "1h04m"),
        (183600, "2d03h"),
    ],
)
def test_durations_read_at_a_glance(seconds, shown):
    assert short_duration(seconds) == shown


def test_a_running_hosts_state_line_carries_the_step_text():
    monitor = JobMonitor({"node0": 0}, "node0", LiveView())
    monitor.apply(
        monitor.hosts["node0"], {"state": "running", "lines": [step_line(5, 50, 3.0, 1e-3, 2500, 0.1)]}
    )
    assert describe(monitor.hosts["node0"]) == "running step 5/50 · 2,500 tok/s"


@pytest.mark.parametrize(
    ("lines", "problem"),
    [("-3", "--lines must be 0 or more, not -3"), ("0", "--lines 0 prints nothing without -f")],
)
def test_logs_refuses_a_line_count_that_shows_nothing_before_reading_anything(lines, problem, capsys):
    # No inventory is read: the count is refused first.
    assert cli.main(["logs", "-i", "/nonexistent", "--lines", lines]) == 2
    assert problem in capsys.readouterr().err
