"""No python the project runs as root imports from the directory it runs in.

Where Ansible logs in as the training account and becomes root, a node-side command's working
directory is that account's home. A python started with `-c` or `-m` puts its working directory
first on the import path, so a module the account planted there (json.py, sysconfig.py, venv.py)
would run as root. Each case here plants modules that leave a marker file when imported, makes the
planted dir the working directory, and runs the project's own command (the launcher's node command,
trainer_env's tasks through ansible-playbook): the command works and no marker appears."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import yaml

#: Only the tests marked slow below are slow (tests/local/conftest.py marks every test of a module
#: here slow unless the module says this).
ALL_SLOW = False

REPO = Path(__file__).resolve().parents[2]
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
ROLE_TASKS = REPO / "roles" / "trainer_env" / "tasks"
ACTION_PLUGIN = (
    REPO / "trainer" / "controller" / "launcher" / "playbooks" / "action_plugins" / "launch_node.py"
)


def planted_home(tmp_path: Path, *modules: str) -> tuple[Path, Path]:
    """(home, marker): a home dir holding `modules`, each of which writes the marker when imported."""
    home, marker = tmp_path / "home", tmp_path / "planted-module-ran"
    home.mkdir()
    for module in modules:
        (home / f"{module}.py").write_text(f"open({str(marker)!r}, 'a').write({module!r} + '\\n')\n")
    return home, marker


def test_the_launchers_node_command_does_not_import_from_its_working_directory(tmp_path):
    home, marker = planted_home(tmp_path, "json", "marshal", "stat")
    spec = importlib.util.spec_from_file_location("launch_node", ACTION_PLUGIN)
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    # A status request, as `trainer status` sends it, for a launch that never started here.
    request = {
        "op": "status",
        "node_dir": str(tmp_path / "node-0"),
        "tail": 5,
        "program": plugin.NODE_PROGRAM,
    }
    done = subprocess.run(
        plugin.node_command(str(VENV_PYTHON), 60),
        shell=True,
        input=json.dumps(request),
        capture_output=True,
        text=True,
        cwd=home,
        timeout=120,
    )
    assert not marker.exists(), f"the planted module ran: {marker.read_text()}"
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["state"] == "none"


def role_task(file: str, name: str) -> dict:
    tasks = yaml.safe_load((ROLE_TASKS / file).read_text())
    return next(task for task in tasks if task.get("name", "").startswith(name))


def run_tasks(home: Path, variables: dict, tasks: list[dict]) -> subprocess.CompletedProcess:
    """The role's tasks as ansible-playbook runs them on a node, in `home`: over SSH a module runs in
    the login's home; over a local connection in the playbook's directory, so the playbook is put there."""
    play = [
        {
            "hosts": "localhost",
            "connection": "local",
            "gather_facts": False,
            "vars": {"ansible_python_interpreter": sys.executable, **variables},
            "tasks": tasks,
        }
    ]
    playbook = home / "play.yml"
    playbook.write_text(yaml.safe_dump(play, sort_keys=False))
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", str(playbook)],
        capture_output=True,
        text=True,
        cwd=home,
        timeout=600,
    )


def test_trainer_envs_state_probe_does_not_import_from_its_working_directory(tmp_path):
    """node_env.py runs as root from the login's home (where Ansible logs in as another account)."""
    home, marker = planted_home(tmp_path, "platform")
    found = tmp_path / "state.json"
    task = role_task("environment.yml", "Read this node's OS, CPU, Python")
    task["ansible.builtin.script"]["cmd"] = task["ansible.builtin.script"]["cmd"].replace(
        "node_env.py", str(REPO / "roles" / "trainer_env" / "files" / "node_env.py")
    )
    keep = {"ansible.builtin.copy": {"content": "{{ trainer_env_state_run.stdout }}", "dest": str(found)}}
    args = f"--venv {REPO / '.venv'} --ops {tmp_path / 'ops'} --envs {tmp_path / 'envs'}"
    done = run_tasks(home, {"trainer_env_python": "python3", "trainer_env_node_env_args": args}, [task, keep])
    assert not marker.exists(), f"the planted module ran: {marker.read_text()}"
    assert done.returncode == 0, done.stdout[-3000:]
    # Where the role writes its .pth file: the venv's own site-packages.
    state = json.loads(found.read_text())
    assert Path(state["site_packages"]).parent.parent.parent == REPO / ".venv", state
    assert state["site_packages"].endswith("site-packages") and state["installed"] is None


def test_trainer_envs_venv_creation_does_not_import_from_its_working_directory(tmp_path):
    home, marker = planted_home(tmp_path, "venv")
    venv = tmp_path / "venv"
    done = run_tasks(
        home, {"trainer_env_venv": str(venv), "trainer_env_python": "python3"},
        [role_task("install.yml", "Create the venv")],
    )  # fmt: skip
    assert not marker.exists(), f"the planted module ran: {marker.read_text()}"
    assert done.returncode == 0, done.stdout[-3000:]
    assert (venv / "pyvenv.cfg").is_file() and (venv / "bin" / "python").exists(), "the venv was made"
