"""An address in the inventory is an address or a host name, nothing else (issue 26, item 4).

Python's ipaddress accepts an IPv6 scope id holding any text, newlines included
(`fd00:20::11%eth0\\nallow all`), and ignores it in the subnet check. Through cluster_ip or
cluster_ntp_servers such a value wrote `allow all` into the head's chrony.conf (every address may
then query and steer the cluster's time) and a `Match exec` line into the ssh client config, a
command root runs on the next ssh. What a user notices here: the roles' own templates, rendered by
Ansible after the validate role as site.yml runs them, never get the injected line, because the
validate play stops the run naming the host, the variable and the fix; `trainer plan` refuses the
same inventory with exit 2; a plain IPv6 inventory still renders (the control).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainer import exitcodes
from trainer.cli import main

REPO = Path(__file__).resolve().parents[3]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")

#: Every line an attacker's value tries to add: chrony's open door and ssh's root command.
INJECTED = ("allow all", 'Match exec "touch clustertrain-pwned"')
PAYLOAD = "%eth0\n" + "\n".join(INJECTED)

HOSTS = {
    "node-a": {"cluster_ip": "fd00:20::10", "cluster_accelerators": 0, "ssh_trust_node_port": 2222},
    "node-b": {"cluster_ip": "fd00:20::11", "cluster_accelerators": 0, "ssh_trust_node_port": 2222},
}
#: A complete provisioning inventory on an IPv6 cluster network (the validate role's REQUIRED).
CLUSTER_VARS = {
    "ansible_connection": "local",
    "ansible_python_interpreter": sys.executable,
    "cluster_name": "v6",
    "cluster_subnet": "fd00:20::/64",
    "cluster_training_user": "trainer",
    "cluster_training_group": "trainer",
    "cluster_training_uid": 2000,
    "cluster_training_gid": 2000,
    "cluster_shared_dir": "/srv/clustertrain/output",
    "nfs_server_backend": "kernel",
    "cluster_master_port": 29500,
    "cluster_comm_port_range": "29400:29999",
    "cluster_ntp_servers": ["ntp1.example.internal"],
    "training_venv": "/opt/clustertrain/venv",
    "training_procs_per_node": 1,
    "training_engine": "ddp",
}

#: The validate play as site.yml runs it, then the two templates an address reaches as root writes
#: them: the timesync role's chrony.conf (head and worker) and ssh_trust's client drop-in, with the
#: roles' own defaults (their default expressions turn cluster_ip and cluster_ntp_servers into
#: timesync_allowed_clients and timesync_upstream_servers).
PLAYBOOK = f"""---
- name: Validate the inventory on the controller, as site.yml does
  hosts: localhost
  connection: local
  gather_facts: false
  any_errors_fatal: true
  roles:
    - role: validate

- name: Render the roles' own templates
  hosts: cluster
  gather_facts: false
  tasks:
    - name: The timesync role's defaults
      ansible.builtin.include_vars: {REPO}/roles/timesync/defaults/main.yml
    - name: Render chrony.conf and the ssh client drop-in
      ansible.builtin.template:
        src: "{REPO}/roles/{{{{ item.role }}}}/templates/{{{{ item.src }}}}"
        dest: "{{{{ render_dir }}}}/{{{{ inventory_hostname }}}}-{{{{ item.src | basename }}}}"
        mode: "0644"
      loop:
        - {{role: timesync, src: etc/chrony/chrony.conf.j2}}
        - {{role: ssh_trust, src: etc/ssh/ssh_config.d/clustertrain.conf.j2}}
"""


def write_inventory(root: Path, hosts: dict, cluster_vars: dict) -> Path:
    inventory = root / "inventory"
    (inventory / "group_vars" / "cluster").mkdir(parents=True)
    tree = {
        "cluster": {
            "children": {
                "head": {"hosts": {"node-a": hosts["node-a"]}},
                "workers": {"hosts": {"node-b": hosts["node-b"]}},
            }
        }
    }
    (inventory / "hosts.yml").write_text(yaml.safe_dump(tree))
    (inventory / "group_vars" / "cluster" / "all.yml").write_text(yaml.safe_dump(cluster_vars))
    return inventory


def render(root: Path, inventory: Path) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """The playbook's result and every file it rendered (name -> text)."""
    rendered = root / "rendered"
    rendered.mkdir()
    (root / "play.yml").write_text(PLAYBOOK)
    env = {**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "roles"), "ANSIBLE_NOCOLOR": "1"}
    done = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), str(root / "play.yml"), "-i", str(inventory), "-e", f"render_dir={rendered}"],
        capture_output=True, text=True, timeout=300, cwd=root, env=env,
    )  # fmt: skip
    return done, {p.name: p.read_text() for p in sorted(rendered.iterdir())}


def injected_lines(files: dict[str, str]) -> list[str]:
    return [
        f"{name}: {line}" for name, text in files.items() for line in text.splitlines() if line in INJECTED
    ]


def scoped(hosts: dict, cluster_vars: dict, variable: str) -> None:
    """Give `variable` an address whose scope id carries the injected lines."""
    if variable == "cluster_ip":
        hosts["node-b"]["cluster_ip"] = "fd00:20::11" + PAYLOAD
    else:
        cluster_vars["cluster_ntp_servers"] = ["ntp1.example.internal", "fd00:20::1" + PAYLOAD]


@pytest.mark.slow
def test_a_plain_ipv6_cluster_renders_its_addresses_into_the_templates(tmp_path):
    """The control: without a scope id the same playbook passes and writes the addresses, so the
    test below would see an injected line if the validate play let one through."""
    done, files = render(tmp_path, write_inventory(tmp_path, HOSTS, CLUSTER_VARS))
    assert done.returncode == 0, done.stdout + done.stderr
    head_chrony = files["node-a-chrony.conf.j2"].splitlines()
    assert "allow fd00:20::11" in head_chrony and "server ntp1.example.internal iburst" in head_chrony
    assert "server fd00:20::10 iburst prefer" in files["node-b-chrony.conf.j2"]
    assert "Host node-b fd00:20::11" in files["node-a-clustertrain.conf.j2"].splitlines()
    assert injected_lines(files) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variable", "host", "message"),
    [
        ("cluster_ip", "host node-b", "cluster_ip is 'fd00:20::11%eth0\\\\nallow all"),
        (
            "cluster_ntp_servers",
            "hosts node-a, node-b",
            "cluster_ntp_servers has 'fd00:20::1%eth0\\\\nallow all",
        ),
    ],
)
def test_a_scope_id_never_reaches_chrony_or_ssh_config_and_validate_names_host_variable_fix(
    tmp_path, variable, host, message
):
    hosts, cluster_vars = copy.deepcopy(HOSTS), copy.deepcopy(CLUSTER_VARS)
    scoped(hosts, cluster_vars, variable)
    done, files = render(tmp_path, write_inventory(tmp_path, hosts, cluster_vars))
    output = done.stdout + done.stderr
    assert injected_lines(files) == [], "the scope id's lines reached a root-written file"
    assert files == {}, "a template was rendered after the validate play"
    assert done.returncode != 0
    assert "Inventory check failed before touching any host" in output, output
    # Ansible prints the problem list as Python reprs: the value's newline shows as \\n.
    assert f"{host}: {message}" in output, output
    assert "an address with a scope id" in output and "fix: write" in output and "without the %zone" in output


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("cluster_ip", "fd00:20::11" + PAYLOAD, "host node-b: cluster_ip is 'fd00:20::11%eth0\\nallow all"),
        (
            "ansible_host",
            "fd00:20::11" + PAYLOAD,
            "host node-b: ansible_host is 'fd00:20::11%eth0\\nallow all",
        ),
        ("cluster_ntp_servers", ["fd00:20::1" + PAYLOAD], "hosts node-a, node-b: cluster_ntp_servers has"),
        ("cluster_subnet", "fd00:20::%eth0\nallow all/64", "hosts node-a, node-b: cluster_subnet is"),
        ("firewall_ssh_sources", ["fd00:20::%eth0/64"], "hosts node-a, node-b: firewall_ssh_sources has"),
    ],
)
def test_trainer_plan_refuses_an_address_with_a_scope_id_with_exit_2(
    tmp_path, capsys, variable, value, expected
):
    """The CLI applies the same validator (load_cluster runs the rule book): exit 2, the host, the
    variable and the fix, for every variable that holds an address."""
    hosts, cluster_vars = copy.deepcopy(HOSTS), copy.deepcopy(CLUSTER_VARS)
    if variable in ("cluster_ip", "ansible_host"):
        hosts["node-b"][variable] = value
    else:
        cluster_vars[variable] = value
    code = main(["plan", "-i", str(write_inventory(tmp_path, hosts, cluster_vars)), "--json"])
    err = capsys.readouterr().err
    assert code == exitcodes.CONFIG_ERROR, err
    line = next((line for line in err.splitlines() if expected in line), None)
    assert line is not None, err
    assert "fix:" in line and ("%zone" in line or "not an address or CIDR" in line), line
