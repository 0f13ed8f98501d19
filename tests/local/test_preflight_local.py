"""`trainer preflight` for real on this machine: the local inventory, and three "nodes" on loopback
addresses (127.0.0.1-3, connection local) so the pair checks, the head listener and iperf3 run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import subreaper

from trainer import exitcodes

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

REPO = Path(__file__).resolve().parents[2]
TRAINER = [sys.executable, "-m", "trainer"]


def preflight(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TRAINER, "preflight", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def test_local_inventory_passes_and_skips_pair_checks(tmp_path):
    # The local inventory's shared dir is the repo's output/, which a fresh clone does not have yet
    # (`make preflight` creates it, as provisioning does on a cluster).
    (REPO / "output").mkdir(exist_ok=True)
    report_path = tmp_path / "preflight.json"
    out = preflight("-i", "inventory/local", "--skip", "deepspeed", "--report", str(report_path))
    assert out.returncode == exitcodes.OK, out.stdout + out.stderr
    assert "preflight passed" in out.stdout
    report = json.loads(report_path.read_text())
    assert report["ok"] is True
    by_check = {r["check"]: r for r in report["results"]}
    for pair_check in ("ssh", "master_port", "clock", "bandwidth"):
        assert by_check[pair_check]["status"] == "skip"
        assert by_check[pair_check]["detail"] == "skipped: one node"
    for node_check in ("accelerators", "versions", "interconnect", "shared_dir", "data"):
        assert by_check[node_check]["status"] == "pass", by_check[node_check]
    assert by_check["deepspeed"]["detail"] == "skipped: --skip"
    # The shared-dir marker file was removed again.
    assert not list((REPO / "output").glob(".preflight-*"))


def test_json_on_stdout_is_the_report_and_everything_else_goes_to_stderr(tmp_path):
    (REPO / "output").mkdir(exist_ok=True)
    report_path = tmp_path / "preflight.json"
    out = preflight("-i", "inventory/local", "--skip", "deepspeed", "--report", str(report_path), "--json")
    assert out.returncode == exitcodes.OK, out.stdout + out.stderr
    printed = json.loads(out.stdout)  # nothing but the report on stdout
    assert printed == json.loads(report_path.read_text())
    assert printed["ok"] is True and "preflight passed" in out.stderr
    if shutil.which("jq"):
        jq = subprocess.run(["jq", "-r", ".ok"], input=out.stdout, capture_output=True, text=True)
        assert jq.stdout.strip() == "true"


def test_json_with_a_config_error_leaves_stdout_empty():
    out = preflight("-i", "inventory/nowhere", "--json")
    assert out.returncode == exitcodes.CONFIG_ERROR
    assert out.stdout == "" and "inventory/nowhere does not exist" in out.stderr


def test_missing_inventory_is_a_config_error():
    out = preflight("-i", "inventory/nowhere")
    assert out.returncode == exitcodes.CONFIG_ERROR
    assert "inventory/nowhere does not exist" in out.stderr


def test_unknown_check_name_is_refused():
    out = preflight("-i", "inventory/local", "--skip", "dns")
    assert out.returncode == 2 and "invalid choice: 'dns'" in out.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loopback_inventory(tmp_path: Path, master_port: int, data_files: dict[str, Path]) -> Path:
    """Three nodes on this machine at 127.0.0.1..3, each with its own data file path."""
    hosts = {
        "node-a": {"cluster_ip": "127.0.0.1"},
        "node-b": {"cluster_ip": "127.0.0.2"},
        "node-c": {"cluster_ip": "127.0.0.3"},
    }
    for name, path in data_files.items():
        hosts[name]["cluster_data_path"] = str(path)
    shared = tmp_path / "shared"
    shared.mkdir()
    inventory = {
        "cluster": {
            "children": {
                "head": {"hosts": {"node-a": hosts["node-a"]}},
                "workers": {"hosts": {"node-b": hosts["node-b"], "node-c": hosts["node-c"]}},
            },
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "cluster_accelerators": 0,
                "cluster_accelerator_model": "cpu",
                "cluster_subnet": "127.0.0.0/8",
                "cluster_training_user": _user(),
                "cluster_shared_dir": str(shared),
                "cluster_master_port": master_port,
                "cluster_comm_port_range": f"{master_port}:{master_port + 20}",
                # Named here; `auto` finds lo too (its 127.0.0.1/8 holds .2 and .3, as launch sees it).
                "cluster_nccl_socket_ifname": "lo",
                "training_procs_per_node": 1,
                "training_venv": str(Path(sys.executable).parents[1]),
            },
        }
    }
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inventory))
    return path


def _user() -> str:
    import os
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


#: Checks that need what a loopback "cluster" on this machine has not: SSH trust, ufw, an NFS server.
NOT_HERE = ("ssh", "ufw", "nfs")


def chrony_here() -> bool:
    return subprocess.run(["sh", "-c", "command -v chronyc"], capture_output=True).returncode == 0


@pytest.mark.slow
def test_loopback_cluster_names_the_changed_data_file_and_the_busy_master_port(tmp_path):
    good = tmp_path / "data-good.txt"
    good.write_text("the same text on every node\n" * 100)
    changed = tmp_path / "data-changed.txt"
    changed.write_text("the same text on every node\n" * 99 + "edited on one node\n")
    port = free_port()
    inventory = loopback_inventory(tmp_path, port, {"node-a": good, "node-b": good, "node-c": changed})
    report_path = tmp_path / "report.json"
    # Something already holds the master port on the head, as a leftover trainer would.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen(1)
        out = preflight("-i", str(inventory), "--report", str(report_path),
                        "--skip", *NOT_HERE, "bandwidth", "deepspeed")  # fmt: skip
    assert out.returncode == exitcodes.PREFLIGHT_FAILED, out.stdout + out.stderr
    report = json.loads(report_path.read_text())
    failed = {(r["check"], r["subject"]): r for r in report["results"] if r["status"] == "fail"}
    clock_failures = {key for key in failed if key[0] == "clock"}
    assert set(failed) - clock_failures == {("data", "node-c"), ("master_port", "node-a")}, out.stdout
    assert "data-changed.txt differs" in failed[("data", "node-c")]["detail"]
    assert f"port {port} on node-a is already in use" in failed[("master_port", "node-a")]["detail"]
    assert (
        "ss -ltnp" in failed[("master_port", "node-a")]["fix"]
        and "node-a" in failed[("master_port", "node-a")]["fix"]
    )
    assert "FAIL  data          node-c" in out.stdout
    # The clocks were still measured, through the clock port from the comm range.
    clocks = [r for r in report["results"] if r["check"] == "clock" and r["subject"] != "node-a"]
    assert all(abs(r["data"]["offset_s"]) < 0.05 for r in clocks)
    if not chrony_here():  # chronyd's own state is checked too: here there is none to ask
        for result in clocks:
            assert result["status"] == "fail" and "chrony is not installed on" in result["detail"]
            assert result["subject"] in result["fix"] and "--tags timesync" in result["fix"]
    # The probe pass is timed on its own, apart from the DeepSpeed job.
    assert 0 < report["probe_duration_s"] <= report["duration_s"]


@pytest.mark.slow
def test_loopback_cluster_bandwidth_in_parallel_rounds(tmp_path):
    port = free_port()
    inventory = loopback_inventory(tmp_path, port, {})
    report_path = tmp_path / "report.json"
    out = preflight("-i", str(inventory), "--report", str(report_path), "--iperf-seconds", "1",
                    "--bandwidth-threshold-gbit", "1000",
                    "--skip", *NOT_HERE, "clock", "deepspeed")  # fmt: skip
    report = json.loads(report_path.read_text())
    assert out.returncode == exitcodes.OK, out.stdout + out.stderr
    matrix = report["bandwidth"]
    assert matrix["nodes"] == ["node-a", "node-b", "node-c"]
    assert len(matrix["rounds"]) == 3
    cells = matrix["matrix"]
    for i in range(3):
        for j in range(3):
            assert (cells[i][j] is None) == (i == j), cells
    # The same matrix as a PNG heatmap beside the report, named in it, drawn from these numbers.
    from matplotlib.image import imread

    from trainer.controller.preflight.report import bandwidth_heatmap

    assert matrix["heatmap"] == "report-bandwidth.png"
    assert imread(tmp_path / matrix["heatmap"])[..., :3].std() > 0.05, "blank heatmap"
    assert bandwidth_heatmap(matrix).axes[0].images[0].get_array().tolist() == cells
    # Below the (absurd) 1000 Gbit/s threshold: a warning with the ZeRO advice, not a failure.
    warnings = [r for r in report["results"] if r["check"] == "bandwidth"]
    assert len(warnings) == 3 and all(r["status"] == "warn" for r in warnings)
    assert "ZeRO-2" in out.stdout and "ZeRO-3" in out.stdout
    # The iperf3 servers were stopped after their round.
    assert "iperf3 -s" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def stale_lock_inventory(tmp_path: Path) -> tuple[Path, Path]:
    """A loopback cluster whose training_env points torch at its own extensions dir, where a killed
    DeepSpeed build left its lock (a real file no process holds), as in the issue."""
    inventory = loopback_inventory(tmp_path, free_port(), {})
    data = yaml.safe_load(inventory.read_text())
    extensions = tmp_path / "torch_extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    data["cluster"]["vars"]["training_env"] = {"TORCH_EXTENSIONS_DIR": str(extensions)}
    inventory.write_text(yaml.safe_dump(data))
    return inventory, lock


#: The tags that a preflight's processes carry: its DeepSpeed job's launch id, and its probes' token.
LAUNCH_TAG = "CLUSTERTRAIN_LAUNCH_ID=preflight-deepspeed-"
PROBE_TAG = "CLUSTERTRAIN_PREFLIGHT="


def under_subreaper(tags: list[str], command: list[str]) -> tuple[list[str], dict[str, str]]:
    """argv and environment that run `command` under helpers/subreaper.py: what the preflight leaves
    is found by descent, not by its tags alone (CI runs other chunks' preflights at the same time,
    whose processes carry the same tags). Its first line is the command's pid, its last `LEFT [...]`."""
    argv = [sys.executable, "-m", "helpers.subreaper", *tags, "--", *command]
    return argv, {**os.environ, "PYTHONPATH": str(REPO / "tests")}


@pytest.mark.slow
def test_a_stale_build_lock_is_named_and_the_deepspeed_job_not_started(tmp_path):
    inventory, lock = stale_lock_inventory(tmp_path)
    report_path = tmp_path / "report.json"
    out = preflight(
        "-i", str(inventory), "--report", str(report_path), "--skip", *NOT_HERE, "clock", "bandwidth"
    )
    assert out.returncode == exitcodes.PREFLIGHT_FAILED, out.stdout + out.stderr
    report = json.loads(report_path.read_text())
    ops = {r["subject"]: r for r in report["results"] if r["check"] == "deepspeed_ops"}
    for host in ("node-a", "node-b", "node-c"):
        assert ops[host]["status"] == "fail" and f"stale build lock {lock}" in ops[host]["detail"]
        assert f"on {host}" in ops[host]["fix"] and f"rm -rf {lock.parent}" in ops[host]["fix"]
    job = next(r for r in report["results"] if r["check"] == "deepspeed")
    assert job["status"] == "skip" and "deepspeed_ops (node-a)" in job["detail"]
    assert lock.exists()  # named, not removed: it is not preflight's to delete


@pytest.mark.slow
def test_a_deepspeed_job_stuck_in_its_compile_is_named_and_stopped_on_every_node(tmp_path):
    """The fast pass is told to look away (--skip deepspeed_ops): the job then hangs on the stale
    lock, as in the issue; past the compile phase's bound it is named and stopped everywhere."""
    inventory, lock = stale_lock_inventory(tmp_path)
    report_path = tmp_path / "report.json"
    argv, env = under_subreaper([LAUNCH_TAG], [*TRAINER, "preflight", "-i", str(inventory),
                                "--report", str(report_path), "--skip", *NOT_HERE, "clock", "bandwidth",
                                "deepspeed_ops", "--deepspeed-bound", "compile=20"])  # fmt: skip
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == exitcodes.PREFLIGHT_FAILED, out.stdout + out.stderr
    report = json.loads(report_path.read_text())
    job = next(r for r in report["results"] if r["check"] == "deepspeed")
    assert job["status"] == "fail" and job["data"]["phase"] == "compile", job
    assert job["data"]["hosts"] == ["node-a", "node-b", "node-c"]
    assert "stalled in phase compile" in job["detail"] and "stopped on every node" in job["detail"]
    assert "node-a" in job["fix"] and "python -m trainer.torch_extensions check" in job["fix"]
    assert "deepspeed: compile" in out.stdout  # the phases were shown as they came
    assert out.stdout.splitlines()[-1] == "LEFT []", "the job's processes outlived the stop"
    # The lock was there before the job: left for the user (the fast pass names it); nothing new.
    assert sorted(p.name for p in lock.parent.iterdir()) == ["lock"]


@pytest.mark.slow
def test_preflight_stopped_in_the_middle_leaves_nothing_running(tmp_path):
    inventory, _ = stale_lock_inventory(tmp_path)
    report_path = tmp_path / "report.json"
    command = [*TRAINER, "preflight", "-i", str(inventory), "--report", str(report_path),
               "--skip", *NOT_HERE, "clock", "bandwidth", "deepspeed_ops"]  # fmt: skip
    tags = [LAUNCH_TAG, PROBE_TAG]
    argv, env = under_subreaper(tags, command)
    wrapper = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    seen = []
    try:
        preflight_pid = int(wrapper.stdout.readline())
        for line in wrapper.stdout:  # wait until the job is in its (stuck) compile
            seen.append(line)
            if "deepspeed: compile" in line:
                break
        # The job's processes are there, below the subreaper (else "none left" would prove nothing).
        assert subreaper.left_behind(wrapper.pid, tags), "".join(seen)
        os.kill(preflight_pid, signal.SIGTERM)
        rest, _ = wrapper.communicate(timeout=300)
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
    output = "".join(seen) + rest
    assert wrapper.returncode == 130, output
    assert "nothing of it is left running" in output
    assert output.splitlines()[-1] == "LEFT []", output[-2000:]
    shared = tmp_path / "shared"
    assert not list(shared.glob(".preflight-*")), "marker files left in the shared dir"
    report = json.loads(report_path.read_text())
    assert report["ok"] is False and any(r["detail"].startswith("interrupted") for r in report["results"])
