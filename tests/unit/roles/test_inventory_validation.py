"""Bad inventories are refused by site.yml's validate play, on the controller, before any host is touched.

Each test writes a throwaway inventory of three hosts that do not exist, runs the real
`ansible-playbook site.yml` against it and checks three things a user would notice: the run fails,
the message names the host and the variable (and the fix), and no host was contacted. "Contacted"
is measured, not assumed: every host's SSH executable is a trap script that records each call
(and exits 255 without opening any connection), and a control test proves the trap fires when the
inventory is good.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")

GOOD_HOSTS = {
    "node-a": {"cluster_ip": "10.77.0.10", "cluster_accelerators": 8},
    "node-b": {"cluster_ip": "10.77.0.11", "cluster_accelerators": 8},
    "node-c": {"cluster_ip": "10.77.0.12", "cluster_accelerators": 8},
}
GOOD_VARS = {
    "cluster_name": "throwaway",
    "cluster_subnet": "10.77.0.0/24",
    "cluster_training_user": "trainer",
    "cluster_training_group": "trainer",
    "cluster_training_uid": 2000,
    "cluster_training_gid": 2000,
    "cluster_shared_dir": "/srv/clustertrain/output",
    "nfs_server_backend": "kernel",
    "cluster_data_path": "",
    "cluster_master_port": 29500,
    "cluster_comm_port_range": "29400:29999",
    "cluster_ntp_servers": [],
    "cluster_nccl_socket_ifname": "auto",
    "cluster_nccl_ib_disable": "auto",
    "cluster_nccl_debug": "WARN",
    "cluster_nccl_timeout_s": 1800,
    "training_venv": "/opt/clustertrain/venv",
    "training_procs_per_node": 8,
    "training_engine": "deepspeed",
    "training_zero_stage": 2,
    "training_config": "",
    "training_wheelhouse": "",
    "training_workdir": "",
    "training_env": {"NCCL_IB_HCA": "mlx5_0", "WANDB_API_KEY": {"value": "k", "secret": True}},
    # Issue 13's variables, set to good values: the control test proves they pass.
    "training_user_home": "/home/trainer",
    "cluster_nfs_sec": "krb5p",
    "ssh_trust_key_from": ["10.77.0.0/24", "!10.77.0.99"],
}


def write_inventory(root: Path, hosts: dict, cluster_vars: dict, head: list[str], workers: list[str]) -> Path:
    """Write hosts.yml + group_vars/cluster/all.yml; every host's SSH is the trap in `root`."""
    trap = root / "ssh-trap"
    trap.write_text(f'#!/bin/sh\necho "$@" >> {root / "contacted"}\nexit 255\n')
    trap.chmod(0o755)
    port = iter(range(40001, 40100))
    entries = {
        name: {
            "ansible_host": "127.0.0.1",
            "ansible_port": next(port),
            "ansible_ssh_executable": str(trap),
            **hv,
        }
        for name, hv in hosts.items()
    }
    inventory = {
        "cluster": {
            "children": {
                "head": {"hosts": {n: entries[n] for n in head}},
                "workers": {"hosts": {n: entries[n] for n in workers}},
            }
        }
    }
    inv = root / "inventory"
    (inv / "group_vars" / "cluster").mkdir(parents=True)
    (inv / "hosts.yml").write_text(yaml.safe_dump(inventory))
    (inv / "group_vars" / "cluster" / "all.yml").write_text(yaml.safe_dump(cluster_vars))
    return inv


def run_site(inventory: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, ANSIBLE_CACHE_PLUGIN="memory", ANSIBLE_NOCOLOR="1")
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "site.yml", "-i", str(inventory)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )


def contacted(root: Path) -> bool:
    return (root / "contacted").exists()


# Each case: (id, change to the good inventory, text the failure must contain).
# A change is a function (hosts, vars, head, workers) -> None that edits them in place.
def _set(var, value):
    def change(hosts, cluster_vars, head, workers):
        cluster_vars[var] = value

    return change


def _host(name, var, value):
    def change(hosts, cluster_vars, head, workers):
        if value is None:
            hosts[name].pop(var)
        else:
            hosts[name][var] = value

    return change


def _no_head(hosts, cluster_vars, head, workers):
    workers.insert(0, head.pop())


def _two_heads(hosts, cluster_vars, head, workers):
    head.append(workers.pop(0))


BAD = [
    ("no-head", _no_head, "group 'head' must hold exactly one host", None),
    ("two-heads", _two_heads, "group 'head' must hold exactly one host", "found 2: node-a, node-b"),
    (
        "duplicate-address",
        _host("node-c", "cluster_ip", "10.77.0.11"),
        "node-c: cluster_ip 10.77.0.11 is also",
        None,
    ),
    (
        "unequal-accelerators",
        _host("node-b", "cluster_accelerators", 4),
        "node-b: cluster_accelerators is 4",
        "node-a has 8",
    ),
    ("world-subnet", _set("cluster_subnet", "0.0.0.0/0"), "cluster_subnet is 0.0.0.0/0", "whole world"),
    ("world-subnet-v6", _set("cluster_subnet", "::/0"), "cluster_subnet is ::/0", "whole world"),
    ("star-subnet", _set("cluster_subnet", "*"), "cluster_subnet is *", "whole world"),
    ("uid-below-1000", _set("cluster_training_uid", 999), "cluster_training_uid is 999", "1000 or above"),
    ("gid-below-1000", _set("cluster_training_gid", 100), "cluster_training_gid is 100", "1000 or above"),
    (
        "uid-collision",
        _host("node-b", "cluster_training_uid", 2001),
        "cluster_training_uid differs between hosts",
        "node-b=2001",
    ),
    (
        "relative-shared-dir",
        _set("cluster_shared_dir", "output"),
        "cluster_shared_dir is 'output', not an absolute path",
        None,
    ),
    ("relative-venv", _set("training_venv", "venv"), "training_venv is 'venv', not an absolute path", None),
    ("master-port-low", _set("cluster_master_port", 80), "cluster_master_port is 80", "1024 to 65535"),
    ("master-port-high", _set("cluster_master_port", 70000), "cluster_master_port is 70000", "1024 to 65535"),
    (
        "comm-range-reversed",
        _set("cluster_comm_port_range", "29999:29400"),
        "cluster_comm_port_range is '29999:29400'",
        None,
    ),
    ("zero-procs", _set("training_procs_per_node", 0), "training_procs_per_node is 0", "1 or more"),
    (
        "more-procs-than-gpus",
        _set("training_procs_per_node", 16),
        "training_procs_per_node is 16 but the host has 8 GPUs",
        None,
    ),
    (
        "bad-engine",
        _set("training_engine", "horovod"),
        "training_engine is 'horovod'",
        "ddp, deepspeed, accelerate",
    ),
    ("bad-zero-stage", _set("training_zero_stage", 4), "training_zero_stage is 4", "use one of 1, 2, 3"),
    (
        "bad-nfs-backend",
        _set("nfs_server_backend", "samba"),
        "nfs_server_backend is 'samba'",
        "kernel, ganesha",
    ),
    ("missing-cluster-ip", _host("node-c", "cluster_ip", None), "host node-c: cluster_ip is not set", None),
    (
        "address-outside-subnet",
        _host("node-b", "cluster_ip", "10.99.0.11"),
        "node-b: cluster_ip 10.99.0.11 is outside",
        None,
    ),
    ("root-training-user", _set("cluster_training_user", "root"), "cluster_training_user is root", None),
    (
        "training-env-launcher-variable",
        _set("training_env", {"NODE_RANK": 1}),
        "training_env: NODE_RANK is set by the launcher",
        "fix: remove it from training_env",
    ),
    (
        "training-env-bad-name",
        _set("training_env", {"HF-HOME": "/x"}),
        "training_env: 'HF-HOME' is not a valid environment variable name",
        None,
    ),
    (
        "training-env-not-a-mapping",
        _set("training_env", ["HF_HOME=/x"]),
        "training_env is ['HF_HOME=/x'], not a mapping",
        None,
    ),
    (
        "training-env-list-value",
        _set("training_env", {"NCCL_IB_HCA": ["mlx5_0"]}),
        "training_env.NCCL_IB_HCA is ['mlx5_0']",
        "give a string or a number",
    ),
    (
        "relative-workdir",
        _host("node-b", "training_workdir", "code"),
        "host node-b: training_workdir is 'code', not an absolute path",
        None,
    ),
    ("bad-ib-disable", _set("cluster_nccl_ib_disable", 2), "cluster_nccl_ib_disable is 2", "use auto"),
    (
        "missing-wheelhouse",
        _set("training_wheelhouse", "/nonexistent/wheels"),
        "does not exist on the controller",
        None,
    ),
]


@pytest.mark.parametrize(
    ("change", "expected", "also"), [case[1:] for case in BAD], ids=[case[0] for case in BAD]
)
def test_bad_inventory_fails_in_validate_without_contacting_hosts(tmp_path, change, expected, also):
    hosts, cluster_vars = copy.deepcopy(GOOD_HOSTS), copy.deepcopy(GOOD_VARS)
    head, workers = ["node-a"], ["node-b", "node-c"]
    change(hosts, cluster_vars, head, workers)
    result = run_site(write_inventory(tmp_path, hosts, cluster_vars, head, workers))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Inventory check failed before touching any host" in output, output
    assert expected in output, output
    if also:
        assert also in output, output
    assert "fix:" in output
    # Stopped in the validate play: no later play started, no host was contacted.
    assert "PLAY [Training account" not in output
    assert not contacted(tmp_path), (tmp_path / "contacted").read_text()


def test_several_problems_are_reported_at_once(tmp_path):
    cluster_vars = dict(
        GOOD_VARS, cluster_subnet="0.0.0.0/0", cluster_training_uid=500, cluster_master_port=22
    )
    result = run_site(
        write_inventory(tmp_path, copy.deepcopy(GOOD_HOSTS), cluster_vars, ["node-a"], ["node-b", "node-c"])
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0
    for text in ("cluster_subnet is 0.0.0.0/0", "cluster_training_uid is 500", "cluster_master_port is 22"):
        assert text in output
    assert not contacted(tmp_path)


def test_good_inventory_passes_validate_and_then_reaches_the_hosts(tmp_path):
    """The control: with nothing wrong, validation passes and the next play does contact the hosts
    (the trap records it), so the assertions above would notice a validate play that let a bad
    inventory through."""
    inventory = write_inventory(
        tmp_path, copy.deepcopy(GOOD_HOSTS), copy.deepcopy(GOOD_VARS), ["node-a"], ["node-b", "node-c"]
    )
    result = run_site(inventory)
    output = result.stdout + result.stderr
    assert "Inventory OK: head node-a, 2 worker(s), 8 accelerator(s) per node." in output, output
    assert result.returncode != 0  # the hosts do not exist
    assert contacted(tmp_path)
    assert "UNREACHABLE" in output


# --- One set of rules: site.yml's validate play and `trainer plan` refuse the same inventories ------

#: Values found to get through before (issue 15) or left unchecked (issue 13): each reached a config
#: file or shell line (exports, chrony.conf, run.sh, the DeepSpeed hostfile, fstab, authorized_keys).
REPRODUCTIONS = [
    (
        "shared-dir-opens-the-export",
        _set("cluster_shared_dir", "/srv/share *(rw,no_root_squash,insecure)"),
        "cluster_shared_dir is '/srv/share *(rw,no_root_squash,insecure)': whitespace, quotes, parentheses",
    ),
    ("shared-dir-is-root", _set("cluster_shared_dir", "/"), "cluster_shared_dir is /, the whole file system"),
    (
        "shared-dir-climbs",
        _set("cluster_shared_dir", "/srv/.."),
        "cluster_shared_dir is '/srv/..', which climbs",
    ),
    ("venv-with-space", _set("training_venv", "/opt/my venv"), "training_venv is '/opt/my venv': whitespace"),
    (
        "workdir-with-quote",
        _set("training_workdir", "/srv/x'y"),
        'training_workdir is "/srv/x\'y": whitespace',
    ),
    ("data-path-with-newline", _set("cluster_data_path", "/srv/d\nx"), "cluster_data_path is '/srv/d"),
    (
        "ntp-server-with-newline",
        _set("cluster_ntp_servers", ["ntp1.example.internal\nallow 0.0.0.0/0"]),
        "not a host name or IP address; fix: write a YAML list of host names or addresses",
    ),
    (
        "ntp-servers-not-a-list",
        _set("cluster_ntp_servers", "ntp1"),
        "cluster_ntp_servers is 'ntp1', not a list",
    ),
    (
        "host-name-with-newline",
        lambda hosts, cluster_vars, head, workers: _rename(hosts, workers, "node-c", "node-c\nevil"),
        "cannot be written into run.sh, known_hosts or ssh_config",
    ),
    (
        "cluster-ip-with-newline",
        _host("node-a", "cluster_ip", "127.0.0.1\nevil slots=64"),
        "host node-a: cluster_ip is '127.0.0.1",
    ),
    ("zero-stage-0", _set("training_zero_stage", 0), "training_zero_stage is 0; fix: use one of 1, 2, 3"),
    ("timeout-below-the-trainer-minimum", _set("cluster_nccl_timeout_s", 5), "cluster_nccl_timeout_s is 5"),
    ("user-home-is-root", _set("training_user_home", "/"), "training_user_home is /, the whole file system"),
    (
        "user-home-relative",
        _set("training_user_home", "home/trainer"),
        "training_user_home is 'home/trainer', not an absolute path",
    ),
    ("user-home-with-space", _set("training_user_home", "/home/a b"), "training_user_home is '/home/a b'"),
    (
        "nfs-sec-unknown",
        _set("cluster_nfs_sec", "sys,rw"),
        "cluster_nfs_sec is 'sys,rw'; fix: use one of sys, krb5, krb5i, krb5p",
    ),
    (
        "key-from-with-quote",
        _set("ssh_trust_key_from", ['10.77.0.0/24",command="id']),
        "ssh_trust_key_from has '10.77.0.0/24\",command=\"id'",
    ),
    (
        "key-from-a-string",
        _set("ssh_trust_key_from", "10.77.0.0/24"),
        "ssh_trust_key_from is '10.77.0.0/24', not a non-empty list",
    ),
    (
        "key-from-anywhere",
        _set("ssh_trust_key_from", ["*"]),
        "lets a copy of the cluster key log in from anywhere",
    ),
    (
        "bad-interface",
        _set("cluster_nccl_socket_ifname", "eth0; id"),
        "cluster_nccl_socket_ifname is 'eth0; id'",
    ),
    (
        "ansible-host-an-ssh-option",
        _host("node-b", "ansible_host", "-oProxyCommand=id"),
        "host node-b: ansible_host is '-oProxyCommand=id', not a host name or IP address",
    ),
    (
        "ssh-sources-a-ufw-clause",
        _set("firewall_ssh_sources", ["10.0.0.0/8 proto udp"]),
        "firewall_ssh_sources has '10.0.0.0/8 proto udp', not an address or CIDR",
    ),
    (
        "ssh-port-zero",
        _set("firewall_ssh_port", 0),
        "firewall_ssh_port is 0; fix: use a port number from 1 to 65535",
    ),
]


def _rename(hosts, workers, old, new):
    hosts[new] = hosts.pop(old)
    workers[workers.index(old)] = new


def plan_problems(inventory: Path, capsys) -> tuple[int, list[str]]:
    """`trainer plan --json`'s exit code and the problems it lists (one per indented line)."""
    from trainer.cli import main

    code = main(["plan", "-i", str(inventory), "--json"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, [line.strip() for line in captured.err.splitlines() if line.startswith("  ")]


@pytest.mark.parametrize(
    ("change", "expected"), [c[1:] for c in REPRODUCTIONS], ids=[c[0] for c in REPRODUCTIONS]
)
def test_site_and_plan_refuse_the_same_inventory_with_the_same_message(tmp_path, capsys, change, expected):
    hosts, cluster_vars = copy.deepcopy(GOOD_HOSTS), copy.deepcopy(GOOD_VARS)
    head, workers = ["node-a"], ["node-b", "node-c"]
    change(hosts, cluster_vars, head, workers)
    inventory = write_inventory(tmp_path, hosts, cluster_vars, head, workers)
    before = sorted(tmp_path.rglob("*"))

    code, problems = plan_problems(inventory, capsys)
    assert code == 2, problems
    assert any(expected in p for p in problems), problems
    assert all("fix:" in p for p in problems), problems
    assert sorted(tmp_path.rglob("*")) == before, "trainer plan wrote a file"

    result = run_site(inventory)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "Inventory check failed before touching any host" in output, output
    for problem in problems:  # word for word: Ansible prints the list of messages as Python reprs
        assert repr(problem) in output, (problem, output)
    assert "PLAY [Training account" not in output
    assert not contacted(tmp_path)


def test_plan_lists_every_problem_at_once(tmp_path, capsys):
    cluster_vars = dict(
        GOOD_VARS,
        cluster_shared_dir="/",
        cluster_nfs_sec="none",
        training_user_home="~trainer",
        cluster_master_port=22,
    )
    inventory = write_inventory(
        tmp_path, copy.deepcopy(GOOD_HOSTS), cluster_vars, ["node-a"], ["node-b", "node-c"]
    )
    code, problems = plan_problems(inventory, capsys)
    assert code == 2
    for var in ("cluster_shared_dir", "cluster_nfs_sec", "training_user_home", "cluster_master_port"):
        assert any(f"hosts node-a, node-b, node-c: {var} is" in p for p in problems), (var, problems)


def test_plan_accepts_the_good_inventory(tmp_path, capsys):
    """The control for the plan half: the same good inventory site.yml passes is planned (exit 0)."""
    from trainer.cli import main

    inventory = write_inventory(
        tmp_path, copy.deepcopy(GOOD_HOSTS), copy.deepcopy(GOOD_VARS), ["node-a"], ["node-b", "node-c"]
    )
    assert main(["plan", "-i", str(inventory), "--json"]) == 0, capsys.readouterr().err
    assert '"master_addr": "10.77.0.10"' in capsys.readouterr().out


def test_the_rules_accept_what_the_trainer_accepts():
    """One source of truth: the ZeRO stages, engines and shortest timeout the inventory rules allow
    are exactly those the trainer's own config loader allows (the rules cannot import it: no torch
    on a controller, no project dependencies in Ansible's filter plugin)."""
    from trainer.configerror import ConfigError
    from trainer.controller import inventory_rules
    from trainer.controller.launcher import plan
    from trainer.node.config import load_config

    def trainer_accepts(*sets: str) -> bool:
        try:
            load_config(None, list(sets))
        except ConfigError:
            return False
        return True

    engine = "distributed.engine=deepspeed"
    stages = [s for s in range(-1, 6) if trainer_accepts(engine, f"distributed.zero_stage={s}")]
    assert tuple(stages) == inventory_rules.ZERO_STAGES
    candidates = ("ddp", "deepspeed", "accelerate", "fsdp", "horovod", "megatron")
    engines = [e for e in candidates if trainer_accepts(f"distributed.engine={e}")]
    assert tuple(engines) == inventory_rules.ENGINES == plan.ENGINES
    shortest = next(t for t in range(0, 100) if trainer_accepts(f"distributed.timeout_s={t}"))
    assert shortest == inventory_rules.MIN_TIMEOUT_S


def test_launch_and_preflight_refuse_like_plan_and_write_nothing(tmp_path, capsys, monkeypatch):
    """`trainer launch` and `trainer preflight` load the inventory through the same rules: exit 2
    with the same problems, before a run directory, a report or a cache file is written."""
    from trainer.cli import main

    # A user's home exists before the command: the launch's early ansible-playbook (started while
    # the plan is made, canceled when the plan fails) makes Ansible's ~/.ansible in it, as any
    # Ansible run does; the home itself is not something the launch wrote.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / ".cache"))
    (tmp_path / "home").mkdir()
    hosts = copy.deepcopy(GOOD_HOSTS)
    hosts["node-a"]["cluster_ip"] = "127.0.0.1\nevil slots=64"
    cluster_vars = dict(GOOD_VARS, cluster_shared_dir="/", training_user_home="/home/a b")
    inventory = write_inventory(tmp_path, hosts, cluster_vars, ["node-a"], ["node-b", "node-c"])
    code, planned = plan_problems(inventory, capsys)
    assert code == 2 and len(planned) == 3, planned
    # Ansible makes its own empty local temp dir (~/.ansible/tmp) when it loads; nothing else may appear.
    before = _files_but_ansibles(tmp_path)

    report = tmp_path / "reports" / "preflight.json"
    for argv in (
        ["launch", "-i", str(inventory)],
        ["preflight", "-i", str(inventory), "--report", str(report)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert [line.strip() for line in err.splitlines() if line.startswith("  ")] == planned, err
    assert _files_but_ansibles(tmp_path) == before, "a file was written"
    assert not report.parent.exists()
    assert not contacted(tmp_path)


def _files_but_ansibles(root: Path) -> list[Path]:
    ansibles = root / "home" / ".ansible"
    return sorted(p for p in root.rglob("*") if p != ansibles and ansibles not in p.parents)
