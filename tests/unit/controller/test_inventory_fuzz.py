"""Property: any value given to any inventory variable is accepted, or refused with an error naming
that variable (exit 2); never a traceback, never a file written. The inventory half of
tests/unit/node/test_config_fuzz.py: values go through the real loader (YAML files, Ansible's variable
precedence and templating) into `trainer plan`, and straight into the shared rules for both
purposes (site.yml's validate play and plan/launch/preflight)."""

from __future__ import annotations

import copy
import json
import os
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trainer import exitcodes
from trainer.cli import main
from trainer.controller import inventory_rules
from trainer.controller.training_env import path_problem

#: Every variable the rules read, plus the one plan turns into a trainer setting on its own.
VARIABLES = (*inventory_rules.VARIABLES, "training_health_webhook_url")
#: Variables plan hands to the trainer's config loader under the trainer's name for them: a bad
#: value is named by that key (the message says "trainer config: health.webhook_url: ...").
TRAINER_KEYS = {"training_health_webhook_url": "health.webhook_url"}

HOSTS = {
    "node-a": {"cluster_ip": "10.77.0.10", "cluster_accelerators": 8},
    "node-b": {"cluster_ip": "10.77.0.11", "cluster_accelerators": 8},
}
GROUP_VARS = {
    "cluster_name": "fuzz",
    "cluster_subnet": "10.77.0.0/24",
    "cluster_training_user": "trainer",
    "cluster_training_group": "trainer",
    "cluster_training_uid": 2000,
    "cluster_training_gid": 2000,
    "cluster_shared_dir": "/srv/clustertrain/output",
    "nfs_server_backend": "kernel",
    "cluster_master_port": 29500,
    "cluster_comm_port_range": "29400:29999",
    "cluster_ntp_servers": [],
    "training_venv": "/opt/clustertrain/venv",
    "training_procs_per_node": 8,
    "training_engine": "deepspeed",
    "training_zero_stage": 2,
}

#: Values a careless operator, a YAML parser or an attacker makes: shell and config-file syntax,
#: Jinja, control characters, paths at the edges, numbers at the edges.
TRICKY = st.sampled_from(
    [
        "", " ", "/", "//", "/.", "/..", "/srv/..", "/srv/share *(rw,no_root_squash)", "/srv/a b",
        "/srv/a\nb", "/srv/'x'", '/srv/"x"', "/srv/$(id)", "/srv/`id`", "/srv/a;b", "/srv/a,b", "relative",
        "~/x", "\x00", "\x1b[2J", "é", "127.0.0.1\nevil slots=64", "10.0.0.1 evil", "0.0.0.0/0", "::/0",
        "*", "any", "auto", "sys", "krb5p", "krb5 ", "none", "{{ undefined_variable }}", "{{ 1 // 0 }}",
        "{{", "{% if %}", "ntp1.example.internal", "-oProxyCommand=id", "65536", "0", "-1", "1e999", "nan",
        "yes", "true", "29999:29400", "1:2:3", "root", "Trainer", "a" * 300, "https://u:p@h.invalid/x",
        "https://h.invalid/\x01",
    ]
)  # fmt: skip
#: IPv6 literals with a scope id (`fe80::1%eth0`): Python's ipaddress accepts any text after the `%`,
#: newlines included, and the subnet check ignored it (issue 26: one wrote `allow all` into chrony.conf).
SCOPED_IPV6 = st.builds(
    lambda address, zone: f"{address}%{zone}",
    st.ip_addresses(v=6).map(str),
    st.one_of(
        st.sampled_from(["eth0", "eth0\nallow all", "1\nMatch exec id"]), st.text(min_size=1, max_size=12)
    ),
)
#: The variables that hold an address (or a list of them), and how a fuzzed address is written there.
ADDRESS_VARIABLES = {
    "cluster_ip": lambda a: a,
    "ansible_host": lambda a: a,
    "cluster_subnet": lambda a: f"{a}/64",
    "cluster_ntp_servers": lambda a: ["ntp1.example.internal", a],
    "firewall_ssh_sources": lambda a: [f"{a}/64"],
    "ssh_trust_key_from": lambda a: [a],
}
SCALARS = st.one_of(
    TRICKY,
    SCOPED_IPV6,
    st.text(max_size=30),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(SCALARS, max_size=3),
    st.dictionaries(st.text(max_size=8), SCALARS, max_size=2),
)
#: Where the value is set: for the whole cluster (group_vars) or on one worker (hosts.yml).
PLACES = st.sampled_from(["group_vars", "node-b"])


def _yaml_safe(value) -> bool:
    """YAML cannot carry NUL or most control characters; a user cannot write them in a file either."""
    text = yaml.safe_dump(value)
    return "\x00" not in text


def _inventory(root: Path, var: str, value, place: str) -> Path:
    hosts = copy.deepcopy(HOSTS)
    group_vars = dict(GROUP_VARS)
    if place == "group_vars":
        group_vars[var] = value
    else:
        hosts[place][var] = value
    tree = {
        "cluster": {
            "children": {
                "head": {"hosts": {"node-a": hosts["node-a"]}},
                "workers": {"hosts": {"node-b": hosts["node-b"]}},
            },
            "vars": {"ansible_connection": "local"},
        }
    }
    inventory = root / "inventory"
    (inventory / "group_vars" / "cluster").mkdir(parents=True)
    (inventory / "hosts.yml").write_text(yaml.safe_dump(tree))
    (inventory / "group_vars" / "cluster" / "all.yml").write_text(yaml.safe_dump(group_vars))
    return inventory


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


def test_the_base_inventory_is_clean():
    """The control: without the fuzzed value the base inventory has no problem, so every problem
    below comes from the value."""
    hostvars = {name: {**GROUP_VARS, **hv} for name, hv in HOSTS.items()}
    groups = {"head": ["node-a"], "workers": ["node-b"], "cluster": ["node-a", "node-b"]}
    for purpose in (inventory_rules.PROVISION, inventory_rules.LAUNCH):
        assert inventory_rules.cluster_problems(hostvars, groups, purpose) == []


@settings(max_examples=400, deadline=None)
@given(var=st.sampled_from(inventory_rules.VARIABLES), value=VALUES, place=PLACES)
def test_the_rules_name_the_variable_of_any_value_they_refuse(var, value, place):
    hostvars = {name: {**GROUP_VARS, **hv} for name, hv in HOSTS.items()}
    for name in hostvars if place == "group_vars" else [place]:
        hostvars[name][var] = value
    groups = {"head": ["node-a"], "workers": ["node-b"], "cluster": ["node-a", "node-b"]}
    for purpose in (inventory_rules.PROVISION, inventory_rules.LAUNCH):
        problems = inventory_rules.cluster_problems(hostvars, groups, purpose)
        assert all(isinstance(p, str) and "fix:" in p for p in problems), problems
        if problems:
            assert any(var in p for p in problems), (var, value, purpose, problems)


@settings(max_examples=200, deadline=None)
@given(var=st.sampled_from(sorted(ADDRESS_VARIABLES)), address=SCOPED_IPV6, place=PLACES)
@example(var="cluster_ip", address="fd00:77::11%eth0\nallow all", place="node-b")
def test_an_address_with_a_scope_id_is_refused_for_every_address_variable(var, address, place):
    """Whatever the zone holds, no address variable takes it: the roles write these values into
    chrony.conf, ssh_config, exports and ufw rules, none of which has a use for a zone."""
    hostvars = {name: {**GROUP_VARS, **hv} for name, hv in HOSTS.items()}
    for name in hostvars if place == "group_vars" else [place]:
        hostvars[name][var] = ADDRESS_VARIABLES[var](address)
    groups = {"head": ["node-a"], "workers": ["node-b"], "cluster": ["node-a", "node-b"]}
    for purpose in (inventory_rules.PROVISION, inventory_rules.LAUNCH):
        problems = inventory_rules.cluster_problems(hostvars, groups, purpose)
        assert any(var in p and "fix:" in p for p in problems), (var, address, purpose, problems)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(var=st.sampled_from(VARIABLES), value=VALUES.filter(_yaml_safe), place=PLACES)
# Found before (issue 15): each passed plan and reached --master-addr, the hostfile or a config file.
@example(var="cluster_ip", value="127.0.0.1\nevil slots=64", place="node-b")
# Issue 26: a scope id carried a newline into chrony.conf and ssh_config.
@example(var="cluster_ip", value="fd00::11%eth0\nallow all", place="node-b")
@example(var="cluster_shared_dir", value="/srv/share *(rw,no_root_squash,insecure)", place="group_vars")
@example(var="cluster_shared_dir", value="/", place="group_vars")
@example(var="training_zero_stage", value=0, place="group_vars")
# A typo of 2**31 processes per node took 24 GB of the controller before any rule spoke.
@example(var="training_procs_per_node", value=2**31, place="group_vars")
@example(var="cluster_accelerators", value=2**31, place="group_vars")
@example(var="cluster_nccl_timeout_s", value=5, place="group_vars")
@example(var="cluster_training_user", value="{{ undefined_variable }}", place="group_vars")
def test_plan_accepts_or_refuses_naming_the_variable_and_writes_nothing(var, value, place, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        inventory = _inventory(root, var, value, place)
        workdir = root / "cwd"
        workdir.mkdir()
        before = _files(root)
        cwd = os.getcwd()
        os.chdir(workdir)
        try:
            code = main(["plan", "-i", str(inventory), "--json"])
        finally:
            os.chdir(cwd)
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        assert code in (exitcodes.OK, exitcodes.CONFIG_ERROR), (var, value, code, err)
        if code == exitcodes.CONFIG_ERROR:
            assert var in err or TRAINER_KEYS.get(var, var) in err, (var, value, err)
            assert "fix" in err or "use" in err or "set" in err, err
        assert _files(root) == before, "trainer plan wrote a file"
        if code == exitcodes.OK:
            _assert_safe_to_write(json.loads(out))


def _assert_safe_to_write(plan: dict) -> None:
    """What an accepted inventory puts into run.sh, the hostfile and --master-addr is plain: each
    address an IP address or host name, each path a strict absolute path."""
    addresses = [plan["master_addr"], *(node["address"] for node in plan["nodes"])]
    for address in addresses:
        assert inventory_rules.host_or_ip("")(address) is None, address
        # Independent of the rule itself: nothing that could start a new config line or a zone.
        assert address.isprintable() and not any(c in address for c in " %\t"), address
    paths = [plan["output_dir"], plan["training_venv"], *plan["workdirs"].values()]
    for path in paths:
        assert path_problem(path, "") is None, path
    assert inventory_rules.ACCOUNT.fullmatch(plan["training_user"]), plan["training_user"]
    for node in plan["nodes"]:
        assert inventory_rules.IFNAME.fullmatch(node["nccl_socket_ifname"]), node


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(name=st.one_of(TRICKY, st.text(max_size=20)).filter(lambda n: "\x00" not in n))
# Found before: a name Ansible cannot parse ('' or an unclosed '[') left a half-built inventory and
# plan ended in a KeyError traceback; a name too long for a file name failed in Ansible's fact cache
# (a traceback); a newline in a name reached run.sh.
@example(name="")
@example(name="[")
@example(name="a" * 300)
@example(name="node-c\nevil")
def test_any_host_name_is_accepted_or_refused_with_a_fix(name, capsys):
    with tempfile.TemporaryDirectory() as tmp:
        inventory = _inventory(Path(tmp), "cluster_name", "fuzz", "group_vars")
        tree = yaml.safe_load((inventory / "hosts.yml").read_text())
        workers = tree["cluster"]["children"]["workers"]["hosts"]
        workers[name] = workers.pop("node-b")
        (inventory / "hosts.yml").write_text(yaml.safe_dump(tree))
        before = _files(Path(tmp))
        code = main(["plan", "-i", str(inventory), "--json"])
        out, err = capsys.readouterr()
        assert "Traceback" not in out + err
        assert code in (exitcodes.OK, exitcodes.CONFIG_ERROR), (name, code, err)
        if code == exitcodes.CONFIG_ERROR:
            assert "host" in err and "fix" in err, (name, err)
        else:
            assert all(inventory_rules.HOST_NAME.fullmatch(n["host"]) for n in json.loads(out)["nodes"]), out
        assert _files(Path(tmp)) == before, "trainer plan wrote a file"
