"""The converged skip never skips a fix a full run would make, on the bed (issue 26, item 2).

Three ways it did: root could not read the training user's ~/.ssh (a home on NFS that squashes
root), so every item there was recorded as unreadable and never compared again; ssh_trust derives
each node's sshd port from `sshd -T`, which the record did not read, so a changed port left the
other nodes' ssh config on the old one; and `--tags X` or `--check --diff` on a converged cluster ran
no role at all. Each test changes a node the way a user (or NFS) would, runs site.yml with the
converged check on (-e converged_full_run=false, as a user's inventory has it; the bed's inventory
turns it off) and checks what the user would see: the roles run and put the node right.

Every test starts from a fresh record (the one the check compares with): a run that has the check on
(`fresh_record`), which is itself a full run that writes the record where the nodes differ from it,
and a skip of seconds where the run before left it fresh (Molecule's idempotence run for the first
test; a full run on the bed takes about 1.5 min). The test of the four changes runs last of the bed's
session (`bed_last`): its record, written by a root that cannot read ~/.ssh, makes the next checked
run a full one. Every test leaves the bed as it found it: what it changed on a node is undone, and a
full run puts back anything a failure left behind. (The squashed-home case had a test of its own,
with a forced full run to write its record: merged into the port test's runs, CI's bed saves one full
run, ~2.5 min.)
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helpers.testbed_nodes import BED_TEST, ENV, site

REPO = Path(__file__).resolve().parents[2]
SKIPPED = "and this run is made from the same inputs: the roles are skipped"
CONVERGED_ON = ("-e", "converged_full_run=false")
TRAINER_HOME = "/home/trainer"
#: The node whose home reads as a home on NFS that squashes root reads to root: there the converged
#: check's module (the probe, and the read the record is written from) runs without CAP_DAC_OVERRIDE
#: and CAP_DAC_READ_SEARCH, so it cannot open what is inside the training user's 0700 ~/.ssh. Only
#: that module: the roles' other root tasks touch root's own files and local disks, which root still
#: reads where only the home is squashed (the login's temp dir, the head's export).
SQUASHED_HOST = "ct-worker1"
SQUASHED_PYTHON = "/usr/local/bin/clustertrain-test-squashed-python3"
SQUASHED_PYTHON_TEXT = """#!/bin/sh
# tests/testbed/test_converged_limits_testbed.py: the converged check's module runs as root without the
# capabilities that let root read any file (as root on a home on NFS that squashes root).
squashed() {
  exec setpriv --inh-caps=-dac_override,-dac_read_search \\
    --bounding-set=-dac_override,-dac_read_search /usr/bin/python3 "$@"
}
[ "$(id -u)" = 0 ] || exec /usr/bin/python3 "$@"
if [ $# -gt 0 ]; then
  case "$*" in *converged_state*) squashed "$@" ;; esac
  exec /usr/bin/python3 "$@"
fi
module=$(cat)  # pipelining: the module comes on stdin
case "$module" in
  *converged_state*) printf '%s\\n' "$module" | squashed; exit $? ;;
esac
printf '%s\\n' "$module" | /usr/bin/python3
"""
#: A drop-in that makes ct-worker2's sshd listen on 22 besides the bed's 2222 (Ansible keeps coming
#: in on 2222): ssh_trust then derives 22 for it, so the other nodes must stop dialling 2222.
PORT_DROP_IN = "/etc/ssh/sshd_config.d/00-clustertrain-test-port.conf"

pytestmark = BED_TEST


def on_node(
    host: str, script: str, user: str = "root", check: bool = True, stdin: str = ""
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["podman", "exec", "-i", "-u", user, host, "sh", "-euc", script],
        input=stdin, capture_output=True, text=True, env=ENV, check=check, timeout=120,
    )  # fmt: skip


def role_tasks(out: str, role: str) -> int:
    """How many of the role's tasks ran (its argument check runs in every run, tagged always)."""
    return len(re.findall(rf"^TASK \[{role} : (?!Validating arguments against arg spec)", out, re.M))


@pytest.fixture
def full_run_after() -> Iterator[list[bool]]:
    """Put the bed back with a full run at the end when the test says so (or fails before saying)."""
    needed = [True]
    yield needed
    if needed[0]:
        site()


@pytest.fixture
def squashed_inventory(tmp_path) -> Iterator[Path]:
    """An inventory source that runs SQUASHED_HOST's modules through the squashed Python.

    Given after the bed's inventory: its hosts keep their variables (inventory_dir included, which
    the wheelhouse's path is found from) and the host gains only the interpreter, which is not one
    of the converged check's inputs (an ansible_* variable that decides nothing a role writes).
    """
    install = f"cat > {SQUASHED_PYTHON} && chmod 0755 {SQUASHED_PYTHON}"
    on_node(SQUASHED_HOST, install, stdin=SQUASHED_PYTHON_TEXT)
    extra = tmp_path / "squashed.yml"
    squashed = {SQUASHED_HOST: {"ansible_python_interpreter": SQUASHED_PYTHON}}
    extra.write_text(yaml.safe_dump({"all": {"hosts": squashed}}))
    try:
        yield extra
    finally:
        on_node(SQUASHED_HOST, f"rm -f {SQUASHED_PYTHON}")


def fresh_record() -> str:
    """Make every node's record match the node: a run with the converged check on either skips (the
    record is fresh already) or is a full run, which writes it. Its output."""
    out, _ = site(*CONVERGED_ON)
    return out


def port_ct_worker2_is_dialled_on() -> str:
    """The port ssh on the head uses for ct-worker2 (ssh -G: the client's settings, no connection)."""
    settings = on_node("ct-head", "ssh -G ct-worker2", user="trainer").stdout
    return re.search(r"^port (\d+)$", settings, re.M).group(1)


def test_targeted_runs_on_a_converged_cluster_run_their_roles():
    out = fresh_record()
    if SKIPPED not in out:  # it wrote the record: the next plain run is the control
        out, _ = site(*CONVERGED_ON)
    assert SKIPPED in out, "the control: a plain run of the untouched cluster is skipped"

    # A targeted run is what a user reaches for after a change the record does not watch.
    out, recap = site(*CONVERGED_ON, "--tags", "ssh_trust")
    assert role_tasks(out, "ssh_trust") > 0, "--tags ssh_trust runs ssh_trust"
    assert role_tasks(out, "timesync") == 0
    assert {host for host, (_, changed) in recap.items() if changed} == set(), recap

    out, _ = site(*CONVERGED_ON, "--check", "--diff")
    for role in ("users", "ssh_trust", "timesync", "firewall", "nfs_server", "nfs_client", "trainer_env"):
        assert role_tasks(out, role) > 0, f"--check --diff checks {role}"
    assert "the roles are skipped" not in out


def ufw_rules_in_kernel(host: str) -> str:
    return on_node(host, "iptables -S ufw-user-input | grep -c '^-A' || true").stdout.strip()


# Last of the session: its last record, written by a root that cannot read ~/.ssh, makes the next run
# with the check on a full one, which no test after it has to pay for.
@pytest.mark.bed_last
def test_a_changed_port_a_flushed_kernel_a_hand_rule_and_an_unreadable_ssh_dir_make_full_runs_that_fix_each(
    squashed_inventory, full_run_after
):
    """Four changes the record must see, on two nodes at once, in two full runs (about 1.5 min each on
    the bed): each change is named in its run's verdict and put right by that run.

    The first run: ct-worker2's sshd on a new port, ct-worker1's kernel firewall flushed, a port opened
    by hand on ct-worker2. It runs ct-worker1's converged check as a root that cannot read the training
    user's ~/.ssh (squashed_inventory), so the record it writes there lacks those items. The second run
    (the first run's changes undone, and ct-worker1's authorized_keys removed, which root could not
    have seen) must name ~/.ssh as what root cannot read and put the key back."""
    fresh_record()
    assert port_ct_worker2_is_dialled_on() == "2222"
    rules_in_kernel = ufw_rules_in_kernel("ct-worker1")
    assert int(rules_in_kernel) >= 3, "the control: SSH and the cluster's rules are in the kernel"
    assert "8888" not in on_node("ct-worker2", "ufw show added").stdout
    # The control: the squashed root really cannot read the training user's SSH files.
    read_key = f"open('{TRAINER_HOME}/.ssh/id_ed25519.pub')  # converged_state"
    denied = on_node(SQUASHED_HOST, f'{SQUASHED_PYTHON} -c "{read_key}"', check=False)
    assert "PermissionError" in denied.stderr, denied.stderr

    # ct-worker2's sshd also on 22 (Ansible keeps coming in on 2222): ssh_trust now derives 22 for
    # it, so the other nodes must dial 22. ct-worker1: the rules flushed with iptables behind ufw's
    # back (ufw's status, read from its files, still lists them). ct-worker2: a port opened to the
    # world by hand, and a deny rule. Undone as soon as the run has been checked.
    on_node("ct-worker2", f"echo 'Port 22' > {PORT_DROP_IN} && systemctl restart ssh")
    on_node("ct-worker1", "iptables -F ufw-user-input")
    on_node("ct-worker2", "ufw allow 8888/tcp comment 'by hand' && ufw deny 23")
    try:
        out, _ = site(*CONVERGED_ON, inventories=(squashed_inventory,))
        assert SKIPPED not in out, "the port ssh_trust derives for ct-worker2 changed, and the firewalls"
        verdicts = re.findall(r"Every role runs.*", out)
        # ct-worker2's reasons come last in the verdict; the inputs may have changed too (a checkout
        # being edited), so each reason is looked for among them, not first.
        assert re.search(r"ct-worker2: .*sshd ports: 2222 -> (22 2222|2222 22)\b", out), verdicts
        # (ct-worker1's first reason is the ~/.ssh its squashed root cannot read: a path with a dot)
        assert re.search(
            r"ct-worker1: ((?!ct-worker2: ).)*kernel firewall: iptables-save exit 0: \d+ lines", out
        ), verdicts
        assert port_ct_worker2_is_dialled_on() == "22", "the head's ssh config follows the new port"
        # its host key is pinned for 22 too: the login goes through
        on_node("ct-head", "ssh -o BatchMode=yes ct-worker2 true", user="trainer")
        assert "firewall: ufw-user-input: " in out and "0 in the kernel (iptables): reloading ufw" in out
        assert ufw_rules_in_kernel("ct-worker1") == rules_in_kernel, "ufw reloaded its rules"
        added = on_node("ct-worker2", "ufw show added").stdout
        assert "8888" not in added, "the port opened by hand is closed"
        assert "ufw deny 23" in added, "a deny rule only narrows what is open: kept"
        assert "(item=ufw allow 8888/tcp comment 'by hand')" in out, "the removed rule is named"
        assert "TASK [converged : Record it, with the cluster digest, root-only on each node]" in out
    finally:
        on_node("ct-worker2", f"rm -f {PORT_DROP_IN} && systemctl restart ssh")
        on_node("ct-worker2", "ufw delete deny 23", check=False)
    # What NFS would not show root: the cluster key removed from ct-worker1's authorized_keys.
    on_node(SQUASHED_HOST, f"rm {TRAINER_HOME}/.ssh/authorized_keys", user="trainer")
    login = on_node("ct-head", f"ssh -o BatchMode=yes {SQUASHED_HOST} true", user="trainer", check=False)
    assert login.returncode != 0, "the head's login to the worker needs authorized_keys"

    # That run recorded the nodes as it left them (port 22, the deny rule) and ct-worker1 without its
    # ~/.ssh; with both undone the next plain run is a full one again: the other nodes dial 2222 again,
    # the firewall role, run on a right firewall, changes nothing, and ct-worker1's own reason is the
    # ~/.ssh root cannot read (its kernel firewall and everything else are as recorded).
    out, _ = site(*CONVERGED_ON, inventories=(squashed_inventory,))
    assert SKIPPED not in out
    cannot_read = re.findall(rf"root cannot read [^;]*path {TRAINER_HOME}/\.ssh\b", out)
    assert len(cannot_read) == 1, f"said once, naming the item: {cannot_read}\n{out[-4000:]}"
    assert re.search(rf"{SQUASHED_HOST}: ((?!ct-worker2: ).)*root cannot read", out), (
        "ct-worker1's own reason"
    )
    assert role_tasks(out, "ssh_trust") > 0
    on_node("ct-head", f"ssh -o BatchMode=yes {SQUASHED_HOST} true", user="trainer")  # works again
    assert port_ct_worker2_is_dialled_on() == "2222"
    assert role_tasks(out, "firewall") > 0
    assert {task for task in changed_tasks(out) if task.startswith("firewall :")} == set(), out[-3000:]
    full_run_after[0] = False  # that full run put the nodes right; the wrapper goes with its fixture


def changed_tasks(out: str) -> set[str]:
    """The tasks that reported a change on some host (`changed: [host]` under their TASK line)."""
    changed, task = set(), ""
    for line in out.splitlines():
        header = re.match(r"^TASK \[(.*)\]", line)
        if header:
            task = header.group(1)
        elif line.startswith("changed: ["):
            changed.add(task)
    return changed
