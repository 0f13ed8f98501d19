"""`trainer up` on this machine, for real: site.yml on the local inventory (the multi-host roles skip a
one-host cluster), preflight's probe pass, then a launch of the bundled trainer or of a command.

What a user notices: the three phases run in order, each with its time, and a short run finishes; a
phase that fails stops `up` there, names the phase, exits with that phase's code and prints the
command that starts again from it (which really does); bad input is refused with exit 2 before any
phase starts.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from trainer import exitcodes

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

REPO = Path(__file__).resolve().parents[2]
TRAINER = [sys.executable, "-m", "trainer"]
#: The local inventory's shared dir (its group_vars: the repo's output/).
LOCAL_RUNS = REPO / "output" / "runs"
PHASE_TIME = r"^  {phase:<10} +(\d+\.\d) s  {outcome}"
RERUN = re.compile(r"^up: stopped at (\w+) \(exit (\d+)\); to run again from there: (trainer up .*)$", re.M)


def up(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAINER, "up", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def phase_seconds(out: str, phase: str, outcome: str = "ok") -> float:
    found = re.search(PHASE_TIME.format(phase=phase, outcome=outcome), out, re.M)
    assert found, f"no time for {phase} ({outcome}) in:\n{out[-3000:]}"
    return float(found[1])


@pytest.fixture
def run_name():
    """A run name of the test's own on the local inventory; its dir in output/runs is removed after."""
    name = f"up-local-{uuid.uuid4().hex[:8]}"
    yield name
    shutil.rmtree(LOCAL_RUNS / name, ignore_errors=True)


def one_host_inventory(tmp_path: Path, **overrides) -> Path:
    """This machine as a one-host cluster with every variable site.yml requires, its shared dir under
    tmp_path (not created: provisioning a one-host cluster leaves it to the user)."""
    cluster_vars = {
        "cluster_name": "uptest",
        "cluster_subnet": "127.0.0.0/8",
        "cluster_training_user": "root",
        "cluster_training_group": "root",
        "cluster_shared_dir": str(tmp_path / "shared"),
        "nfs_server_backend": "kernel",
        "cluster_data_path": "",
        "cluster_master_port": 29561,
        "cluster_comm_port_range": "1024:65535",
        "cluster_ntp_servers": [],
        "training_venv": str(REPO / ".venv"),
        "training_procs_per_node": 1,
        "training_engine": "ddp",
        "training_config": "",
        "training_workdir": "",
        "training_env": {},
        "training_wheelhouse": "",
    }
    cluster_vars.update(overrides)
    head = {
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "cluster_ip": "127.0.0.1",
        "cluster_accelerators": 0,
        "cluster_accelerator_model": "cpu",
    }
    inventory = {
        "cluster": {
            "children": {"head": {"hosts": {"localhost": head}}, "workers": {"hosts": {}}},
            "vars": {k: v for k, v in cluster_vars.items() if v is not None},
        }
    }
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inventory))
    return path


@pytest.mark.slow
def test_up_provisions_checks_and_trains_in_order_each_phase_timed(tmp_path, run_name):
    (REPO / "output").mkdir(exist_ok=True)  # the local shared dir, as `make preflight` makes it
    report = str(tmp_path / "preflight.json")
    result = up(
        "-i", "inventory/local", "--run-name", run_name, "--preflight-report", report,
        "--set", "train.max_steps=2", "--set", "train.log_every=1",
    )  # fmt: skip
    out = result.stdout
    assert result.returncode == exitcodes.OK, out[-4000:] + result.stderr[-2000:]
    # In this order: provisioning (site.yml's plays named as they start), the probe pass, the launch.
    marks = [
        "up: provision -> preflight -> launch on 1 node(s) (localhost)",
        "up: provision ...",
        "  ... Validate the inventory on the controller, before any host is touched",
        "  ... Trainer venv with the same training stack on every node",
        "up: provision done in ",
        "up: preflight ...",
        "preflight passed",
        "up: preflight done in ",
        "up: launch ...",
        "step 2/2 loss ",
        f"done: run {run_name} finished on all 1 node(s)",
        "up: launch done in ",
        "up: phase times",
    ]
    positions = [out.find(mark) for mark in marks]
    assert -1 not in positions, [m for m, p in zip(marks, positions, strict=True) if p == -1]
    assert positions == sorted(positions), out[-4000:]
    # The probe pass only: the DeepSpeed job (minutes) is not part of `up`.
    assert "tiny DeepSpeed job" not in out
    seconds = {phase: phase_seconds(out, phase) for phase in ("provision", "preflight", "launch")}
    total = float(re.search(r"^  total +(\d+\.\d) s$", out, re.M)[1])
    assert all(s > 0 for s in seconds.values()) and total >= sum(seconds.values()) - 0.2, out[-1500:]
    assert (LOCAL_RUNS / run_name / "checkpoints" / "step-2").is_dir(), "the short run finished"


def test_a_failing_launch_stops_there_with_its_code_and_the_rerun_starts_at_the_launch(tmp_path, run_name):
    (REPO / "output").mkdir(exist_ok=True)
    report = str(tmp_path / "preflight.json")
    result = up("-i", "inventory/local", "--run-name", run_name, "--preflight-report", report, "--from",
                "preflight", "--", "sh", "-c", "exit 3")  # fmt: skip
    out = result.stdout
    # The command's own code is the launch's, and `up` ends with it.
    assert result.returncode == 3, out[-4000:] + result.stderr[-2000:]
    assert "failed: localhost (node 0) exited with code 3" in out  # the launch's own report
    assert "up: launch FAILED in " in out
    assert re.search(r"^  provision +- +left out \(--from\)$", out, re.M), out[-1500:]
    phase_seconds(out, "preflight")
    phase_seconds(out, "launch", "exit 3")
    rerun = RERUN.search(out)
    assert rerun and rerun[1] == "launch" and rerun[2] == "3", out[-1500:]
    assert rerun[3] == (
        f"trainer up -i inventory/local --run-name {run_name} --preflight-report {report} --from launch "
        "-- sh -c 'exit 3'"
    )
    # The printed command, run as printed, starts at the launch: no provisioning, no preflight.
    again = subprocess.run(
        [*TRAINER, *shlex.split(rerun[3])[1:]], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 3, again.stdout[-3000:]
    assert "up: launch -> " not in again.stdout and "up: launch on 1 node(s)" in again.stdout
    assert "up: preflight ..." not in again.stdout and "up: provision ..." not in again.stdout


def test_a_failing_preflight_stops_before_the_launch(tmp_path):
    # A shared dir that does not exist: provisioning a one-host cluster leaves it alone, preflight
    # cannot write there, and nothing is launched.
    inventory = one_host_inventory(tmp_path)
    result = up("-i", str(inventory), "--run-name", "up-preflight-fails", "--preflight-report",
                str(tmp_path / "preflight.json"), "--", "true")  # fmt: skip
    out = result.stdout
    assert result.returncode == exitcodes.PREFLIGHT_FAILED, out[-4000:] + result.stderr[-2000:]
    assert "FAIL  shared_dir    localhost" in out and "No such file or directory" in out
    phase_seconds(out, "provision")
    phase_seconds(out, "preflight", "exit 4")
    assert re.search(r"^  launch +- +not run$", out, re.M), out[-1500:]
    assert "up: launch ..." not in out and not (tmp_path / "shared").exists()
    rerun = RERUN.search(out)
    assert rerun and rerun[1] == "preflight", out[-1500:]
    assert rerun[3].endswith("--from preflight -- true"), rerun[3]


@pytest.mark.parametrize(
    ("problem", "args", "said"),
    [
        (
            "a config key misspelt",
            ["-i", "inventory/local", "--set", "train.max_stepz=2"],
            "train.max_stepz: unknown key; did you mean train.max_steps?",
        ),
        (
            "an inventory only a launch would take (site.yml requires the subnet)",
            ["-i", "{no_subnet}"],
            "cluster_subnet",
        ),
        ("no such inventory", ["-i", "inventory/nowhere"], "inventory inventory/nowhere does not exist"),
        (
            "restart options that do not combine",
            ["-i", "inventory/local", "--allow-batch-change"],
            "--allow-batch-change needs --exclude-failed",
        ),
        (
            "an unknown preflight check",
            ["-i", "inventory/local", "--preflight-skip", "dns"],
            "invalid choice: 'dns'",
        ),
    ],
    ids=["config", "provisioning-rule", "missing-inventory", "options", "preflight-check"],
)
def test_bad_input_is_refused_with_exit_2_before_any_phase(tmp_path, problem, args, said):
    no_subnet = one_host_inventory(tmp_path, cluster_subnet=None)
    result = up(*[arg.format(no_subnet=no_subnet) for arg in args], timeout=120)
    assert result.returncode == exitcodes.CONFIG_ERROR, result.stdout + result.stderr
    assert said in result.stderr, result.stderr
    # Nothing started: no phase line, nothing provisioned or created.
    assert "up: " not in result.stdout, result.stdout
    assert not (tmp_path / "shared").exists()
