"""report.html as a person sees it: a run directory with the files a two-node run with a restart leaves
(run.json, metrics.jsonl with eval and per-node step times, launch/history.jsonl), `trainer report`
writes the page, and a real headless Chromium (Debian's `chromium`) opens it from disk with the network
unreachable: its rendered DOM holds the run's name and numbers, and its screenshot shows the curves."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html import unescape
from pathlib import Path

import pytest

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: A run name and a data path a user could have typed: markup that must come out as text.
RUN_NAME = 'qwen-lora <img src=x onerror="document.title=1"> & "friends"'
DATA_PATH = "/shared/datasets/<script>alert(1)</script>.jsonl"
#: matplotlib's first two line colours (the train loss, the eval loss), as RGB.
BLUE, ORANGE = (31, 119, 180), (255, 127, 14)

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="needs Debian's chromium (scripts/system-packages.txt, group testbed)"
)


def write_run(run_dir: Path) -> None:
    """Twenty logged steps on two nodes (node1 twice as slow), an eval every fifth step, and a history of
    a launch, a lost node, a restart and the second launch."""
    run_dir.mkdir(parents=True)
    config = {
        "output_dir": str(run_dir),
        "train": {"max_steps": 20, "learning_rate": 0.0002, "micro_batch_size": 4},
        "data": {"path": DATA_PATH, "format": "messages"},
        "model": {"name_or_path": "/shared/models/tiny-qwen"},
        "metrics": {"run_name": RUN_NAME, "report_to": []},
    }
    run = {
        "config": config,
        "topology": {"world_size": 4, "num_nodes": 2, "engine": "ddp", "device": "cpu"},
        "data": {"path": DATA_PATH, "samples": 1234, "tokens": 56789, "effective_batch": 16},
    }
    (run_dir / "run.json").write_text(json.dumps(run))
    records = []
    for step in range(1, 21):
        record = {
            "step": step,
            "loss": 4.5 - step * 0.11875,  # ends at 2.125
            "lr": 0.0002,
            "tokens_per_s": 1000.0,
            "step_time_s": 2.0,
            "step_time_s_by_node": {"node0": 1.0, "node1": 2.0},
        }
        if step % 5 == 0:
            record["eval_loss"] = {5: 3.5, 10: 3.0, 15: 2.75, 20: 2.5}[step]
        records.append(record)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "launch").mkdir()
    history = [
        {
            "time": 1795711000.0,
            "event": "launch",
            "nodes": {"node0": 0, "node1": 1},
            "launch_id": "L1",
            "attempt": 1,
        },
        {
            "time": 1795711060.0,
            "event": "stopped",
            "launch_id": "L1",
            "attempt": 1,
            "why": "lost",
            "summary": "node1 (node 1) was lost at step 6: the helper exited with 255",
        },
        {
            "time": 1795711062.0,
            "event": "restart",
            "restart": 1,
            "max_restarts": 2,
            "reason": "node1 (node 1) was lost at step 6",
            "resume_from": "checkpoints/step-6",
            "nodes": {"node0": 0, "node1": 1},
        },
        {
            "time": 1795711070.0,
            "event": "launch",
            "nodes": {"node0": 0, "node1": 1},
            "launch_id": "L2",
            "attempt": 2,
        },
    ]
    (run_dir / "launch" / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))


def chromium(page: Path, *args: str) -> subprocess.CompletedProcess:
    """Chromium headless on the page, its profile in the test's dir. --no-sandbox: the tests run as root,
    where Chromium's sandbox cannot start; the page runs no script anyway (its CSP forbids any)."""
    return subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={page.parent / '.chromium'}", *args, page.as_uri(),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def rows(dom: str) -> list[list[str]]:
    """Every table row of the rendered DOM as its cells' text."""
    found = []
    for row in re.findall(r"<tr>(.*?)</tr>", dom, re.S):
        found.append(
            [
                unescape(re.sub(r"<[^>]+>", "", cell)).strip()
                for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row, re.S)
            ]
        )
    return found


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """(the page, its rendered DOM, its screenshot as an RGB array)."""
    run_dir = tmp_path_factory.mktemp("report") / "run"
    write_run(run_dir)
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "report", str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    page = run_dir / "report.html"
    assert str(page) in done.stdout.splitlines(), done.stdout
    dom = chromium(page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr
    shot = run_dir.parent / "shot.png"
    taken = chromium(page, f"--screenshot={shot}", "--window-size=1280,1400")
    assert shot.is_file(), taken.stderr
    import numpy
    from PIL import Image

    pixels = numpy.asarray(Image.open(shot).convert("RGB")).astype(int)
    return page, dom.stdout, pixels


def test_the_page_shows_the_runs_name_numbers_history_and_config(report):
    page, dom, _ = report
    # The name as typed, as text: no element came out of it.
    assert f"<h1>{RUN_NAME.replace('&', '&amp;').replace('<', '&lt;').replace('>', '&gt;')}</h1>" in dom
    assert "<script" not in dom and 'src="x"' not in dom
    text = unescape(re.sub(r"<[^>]+>", " ", dom))
    assert DATA_PATH in text
    for label, value in [
        ("last train loss", "2.125"),
        ("best eval loss", "2.5"),
        ("world", "4 ranks on 2 node(s)"),
    ]:
        assert re.search(rf"{re.escape(label)}\s+{re.escape(value)}", text), (label, value)
    table = rows(dom)
    assert ["20", "2.5"] in table, "the eval table's last row"
    node1 = next(row for row in table if row and row[0] == "node1")
    # node1: 2 s a step, its half of 1000 tokens/s x 2 s = 1000 tokens -> 500 tokens/s; node0 twice that.
    assert node1 == ["node1", "20", "2,000", "2,000", "500"]
    assert next(row for row in table if row and row[0] == "node0")[-1] == "1,000"
    events = [row[1] for row in table if len(row) == 5 and row[0].endswith("UTC")]
    assert events == ["launch", "stopped", "restart 1/2", "launch"]
    assert any("resumes from checkpoints/step-6" in row[-1] for row in table)
    assert ["train.learning_rate", "0.0002"] in table, "the resolved config"
    assert ["samples", "1,234"] in table, "the data summary"
    # Self-contained: nothing to fetch, everything inline.
    source = page.read_text()
    assert not re.search(r'(src|href)="(?!data:)', source)
    assert "http://" not in source and "https://" not in source


def test_the_curves_are_drawn_on_the_screen(report):
    _, _, pixels = report

    def count(colour: tuple[int, int, int]) -> int:
        return int((abs(pixels - colour).sum(axis=2) < 40).sum())

    # The lines' colours, which nothing else on the page uses: blue for the train loss, the learning rate,
    # the throughput and node0's step time, orange for the eval loss and node1's (each picture is drawn
    # at about 2/3 of its size, so the lines are thin: measured 649 and 278 pixels; 0 and 0 with the
    # pictures broken).
    assert count(BLUE) > 300, count(BLUE)
    assert count(ORANGE) > 150, count(ORANGE)
    blue_rows = (abs(pixels - BLUE).sum(axis=2) < 40).any(axis=1).nonzero()[0]
    assert blue_rows.min() < 700, "the curves come first, near the top of the page"
