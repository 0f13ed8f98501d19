"""The users role's home check on this machine, with root squashed the way an NFS server squashes it.

On an NFS /home exported with root_squash (the default), root on a node is `nobody` on the share:
it cannot create the training user's home in a directory it does not own. The same holds here for
root without the capabilities that override file permissions (setpriv drops dac_override,
dac_read_search and fowner from its bounding set). The role's home.yml runs as that root, through
ansible-playbook, against a directory owned by another account (squashed: refused, naming host,
path and fix, nothing created) and against one of root's own (passes, leaves nothing behind).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ANSIBLE_PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")

PLAY = """---
- name: Check the training user's home
  hosts: localhost
  connection: local
  gather_facts: false
  vars:
    cluster_training_user: trainer
    cluster_training_group: trainer
    cluster_training_uid: 2000
    cluster_training_gid: 2000
    cluster_shared_dir: /nonexistent
  tasks:
    - name: The users role's home check
      ansible.builtin.include_role:
        name: users
        tasks_from: home.yml
"""


SQUASH = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv (util-linux)"
)


def run_as_squashed_root(tmp_path: Path, home: str) -> subprocess.CompletedProcess:
    """ansible-playbook as root that cannot override file permissions."""
    playbook = tmp_path / "home.yml"
    playbook.write_text(PLAY)
    env = {
        **os.environ,
        "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
    }
    return subprocess.run(
        [*SQUASH, str(ANSIBLE_PLAYBOOK), str(playbook), "-e", f"training_user_home={home}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
    )  # fmt: skip


def test_home_on_a_squashed_directory_is_refused_naming_path_and_fix(tmp_path):
    share = tmp_path / "home-share"  # not root's, as an export's /home is not the client root's
    share.mkdir(mode=0o755)
    shutil.chown(share, "nobody", "nogroup")
    home = share / "trainer"
    done = run_as_squashed_root(tmp_path, str(home))
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert f"host localhost: root cannot create training_user_home {home} (" in out, out
    assert "Permission denied" in out
    assert f"mkdir {home}; chown 2000:2000 {home}; chmod 0700 {home}" in out
    assert "set training_user_home to a local directory (e.g. /var/lib/trainer)" in out
    assert list(share.iterdir()) == [], "nothing is created on the share"


def test_home_where_root_may_write_passes_and_leaves_nothing_behind(tmp_path):
    homes = tmp_path / "homes"
    done = run_as_squashed_root(tmp_path, str(homes / "trainer"))
    # The parent does not exist: refused with the reason, not a traceback.
    assert done.returncode != 0 and "No such file or directory" in done.stdout, done.stdout
    homes.mkdir()
    done = run_as_squashed_root(tmp_path, str(homes / "trainer"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(homes.iterdir()) == [], "the check's directory is removed"
    # A home that exists already (made on the file server) needs nothing from root.
    (homes / "trainer").mkdir()
    done = run_as_squashed_root(tmp_path, str(homes / "trainer"))
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_relative_home_is_refused(tmp_path):
    done = run_as_squashed_root(tmp_path, "home/trainer")
    assert done.returncode != 0
    assert 'training_user_home is "home/trainer"; fix: give an absolute path' in done.stdout, done.stdout
