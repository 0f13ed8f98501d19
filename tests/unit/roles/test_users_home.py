"""The users role's home checks on this machine, with root squashed the way an NFS server squashes it.

On an NFS /home exported with root_squash (the default), root on a node is `nobody` on the share:
it cannot create the training user's home in a directory it does not own. The same holds here for
root without the capabilities that override file permissions (setpriv drops dac_override,
dac_read_search and fowner from its bounding set). The role's home.yml runs as that root, through
ansible-playbook, against a directory owned by another account (squashed: refused, naming host,
path and fix, nothing created) and against one of root's own (passes, leaves nothing behind).

Its link check (links.yml, also run by ssh_trust) runs the same way: a home, ~/.ssh or key file that
is a symbolic link is refused naming host and path, and the link's target is left as it was.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
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

LINKS_PLAY = PLAY.replace("The users role's home check", "The users role's link check").replace(
    "tasks_from: home.yml", "tasks_from: links.yml"
)

SQUASH = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv (util-linux)"
)


def run_as_squashed_root(
    tmp_path: Path, home: str, play: str = PLAY, squash: bool = True
) -> subprocess.CompletedProcess:
    """ansible-playbook as root that cannot override file permissions (or, squash=False, plain root)."""
    playbook = tmp_path / "home.yml"
    playbook.write_text(play)
    env = {
        **os.environ,
        "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
    }
    return subprocess.run(
        [*(SQUASH if squash else []), str(ANSIBLE_PLAYBOOK), str(playbook),
         "-e", f"training_user_home={home}"],
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


def _home_of_nobody(tmp_path: Path) -> Path:
    """A home the unprivileged account owns, as the training user owns its own."""
    home = tmp_path / "home" / "trainer"
    home.mkdir(parents=True)
    shutil.chown(home, "nobody", "nogroup")
    return home


def test_a_symlinked_ssh_dir_to_a_root_directory_is_refused_and_the_target_left_alone(tmp_path):
    target = tmp_path / "root-only"  # stands for /root/.ssh or a directory on sudo's secure_path
    target.mkdir(mode=0o700)
    home = _home_of_nobody(tmp_path)
    (home / ".ssh").symlink_to(target)
    os.lchown(home / ".ssh", 65534, 65534)
    done = run_as_squashed_root(tmp_path, str(home), LINKS_PLAY, squash=False)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert f'host localhost: {home}/.ssh is a symbolic link (to "{target}")' in " ".join(out.split()), out
    assert "Nothing was changed on this host" in out
    stat = target.stat()
    assert (stat.st_uid, stat.st_mode & 0o7777) == (0, 0o700) and list(target.iterdir()) == []


@pytest.mark.slow
def test_a_symlinked_home_or_key_file_is_refused_and_real_files_pass(tmp_path):
    home = _home_of_nobody(tmp_path)
    (home / ".ssh").mkdir()
    (home / ".ssh" / "authorized_keys").write_text("")
    done = run_as_squashed_root(tmp_path, str(home), LINKS_PLAY, squash=False)
    assert done.returncode == 0, done.stdout + done.stderr

    (home / ".ssh" / "id_ed25519").symlink_to("/etc/shadow")
    done = run_as_squashed_root(tmp_path, str(home), LINKS_PLAY, squash=False)
    assert done.returncode != 0
    assert f'{home}/.ssh/id_ed25519 is a symbolic link (to "/etc/shadow")' in " ".join(done.stdout.split())

    linked_home = tmp_path / "home" / "linked"
    linked_home.symlink_to(home)
    done = run_as_squashed_root(tmp_path, str(linked_home), LINKS_PLAY, squash=False)
    assert done.returncode != 0
    assert f'{linked_home} is a symbolic link (to "{home}")' in " ".join(done.stdout.split())


def test_a_home_root_may_not_enter_passes_the_link_check(tmp_path):
    """On a root-squashed NFS /home root cannot look inside the home: it follows nothing there."""
    home = _home_of_nobody(tmp_path)
    (home / ".ssh").mkdir()
    home.chmod(0o700)
    done = run_as_squashed_root(tmp_path, str(home), LINKS_PLAY)
    assert done.returncode == 0, done.stdout + done.stderr
