"""Provisioning time: site.yml on the 3-container test bed, cold and idempotent, tuned vs Ansible's defaults.

Every node of the bed is reached over SSH, as on a real cluster (molecule/default/inventory). Runs,
in one go:
  1. cold, defaults:     fresh containers (Molecule destroy + create + prepare), `ansible-playbook
                         site.yml` with Ansible's defaults (an empty config: forks 5, implicit
                         gathering in every play, memory fact cache, no pipelining);
  2. idempotent, defaults: the same again, nothing left to change;
  3. cold, tuned:        fresh containers again, with this repo's ansible.cfg (forks 20, smart
                         gathering + jsonfile fact cache, pipelining and ControlPersist for SSH);
  4. idempotent, tuned:  the same again;
  5. mitogen:            the idempotent run with Mitogen's `mitogen_linear` strategy, when the
                         `mitogen` package is installed (opt-in; make install-mitogen), else
                         said and skipped.
  6. converged:          the idempotent run as a user's inventory has it: the converged check on
                         (the bed's inventory turns it off), so the roles are skipped after one
                         round trip per node (roles/converged/README.md); tuned, with Ansible's
                         defaults, and under Mitogen when installed.
Steps 1-5 are full runs (every role runs: the bed's inventory sets converged_full_run).
With --each, one more idempotent run per setting, each with only that setting back at its default,
so the output says what each one buys. Prints seconds and the ratios.

The test bed is shared: the status file says `down` while this rebuilds it, and `up` again after
the runs (the bed is left converged, as Molecule's verify would leave it).
Usage: python bench/provision.py [--each] [--keep-warm]
  (--keep-warm: reuse the converged bed; no cold runs, only the idempotent ones)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
INVENTORY = REPO / "molecule" / "default" / "inventory"
MOLECULE = REPO / "scripts" / "testbed" / "molecule.sh"
WITH_MITOGEN = REPO / "scripts" / "with-mitogen.sh"
STATUS = Path("/tmp/clustertrain-testbed.status")
PLAYBOOK = Path(sys.executable).with_name("ansible-playbook")
RECAP = re.compile(r"^(\S+)\s+: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)

# Each tuned setting, and the environment that puts just that one back at Ansible's default.
SETTINGS = {
    "forks 20 (default 5)": {"ANSIBLE_FORKS": "5"},
    "gathering smart (default implicit)": {"ANSIBLE_GATHERING": "implicit"},
    "fact cache jsonfile (default memory)": {"ANSIBLE_CACHE_PLUGIN": "memory"},
    "pipelining (default off)": {"ANSIBLE_PIPELINING": "false"},
}


def set_status(text: str) -> None:
    STATUS.write_text(f"{text} {datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}\n")


def molecule(*args: str) -> None:
    """A Molecule step on the bed, quiet; its output's end when it fails."""
    run = subprocess.run(
        [str(MOLECULE), *args, "-s", "default"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    if run.returncode != 0:
        sys.exit(f"molecule {' '.join(args)} failed (rc {run.returncode}):\n{run.stdout.decode()[-4000:]}")


def rebuild_bed() -> None:
    """Fresh containers with the bed's access set-up (SSH keys, ops on port 2222, admin with sudo)."""
    set_status("down")
    molecule("destroy")
    molecule("create")  # Molecule's create runs the dependency step (access.sh) and prepare too


SKIPPED = "the roles are skipped"
CONVERGED = ("-e", "converged_full_run=false")


def run_site(
    label: str,
    env_changes: dict[str, str],
    fact_cache: Path,
    prefix: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
) -> float:
    env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_CACHE_PLUGIN_CONNECTION=str(fact_cache))
    env.update(env_changes)
    started = time.monotonic()
    result = subprocess.run(
        [*prefix, str(PLAYBOOK), "site.yml", "-i", str(INVENTORY), *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.monotonic() - started
    recaps = {m[1]: (int(m[3]), int(m[5])) for m in RECAP.finditer(result.stdout)}
    if result.returncode != 0:
        sys.exit(
            f"{label}: site.yml failed (rc {result.returncode}):\n"
            f"{result.stdout[-4000:]}{result.stderr[-2000:]}"
        )
    changed = sum(c for c, _ in recaps.values())
    if extra == CONVERGED and SKIPPED not in " ".join(result.stdout.split()):  # yaml output folds lines
        label += " - the roles ran"  # a record missing or stale: this measured a full run
    print(f"{label:<60} {seconds:7.1f} s   changed={changed}", flush=True)
    if changed and not label.startswith("cold"):
        # Name what changed: an idempotent run that changes things measures something else.
        task, tasks = "", []
        for line in result.stdout.splitlines():
            if line.startswith("TASK ["):
                task = line[6 : line.find("]")]
            elif line.startswith("changed: ") and task not in tasks:
                tasks.append(task)
        print("    changed tasks: " + "; ".join(tasks), flush=True)
    return seconds


def mitogen_installed() -> bool:
    return importlib.util.find_spec("ansible_mitogen") is not None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--each", action="store_true", help="also measure each setting on its own")
    parser.add_argument("--keep-warm", action="store_true", help="reuse the converged bed; no cold run")
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="clustertrain-bench-facts-") as tmp,
        tempfile.NamedTemporaryFile("w", suffix=".cfg") as empty_cfg,
    ):
        fact_cache = Path(tmp)
        defaults_env = {"ANSIBLE_CONFIG": empty_cfg.name, "ANSIBLE_ROLES_PATH": str(REPO / "roles")}
        results: dict[str, float] = {}
        if not args.keep_warm:
            rebuild_bed()
            results["cold defaults"] = run_site("cold site.yml (Ansible defaults)", defaults_env, fact_cache)
            results["defaults"] = run_site("idempotent site.yml (Ansible defaults)", defaults_env, fact_cache)
            rebuild_bed()
            results["cold"] = run_site("cold site.yml (tuned ansible.cfg)", {}, fact_cache)
        results["idempotent"] = run_site("idempotent site.yml (tuned)", {}, fact_cache)
        if "defaults" not in results:
            results["defaults"] = run_site("idempotent site.yml (Ansible defaults)", defaults_env, fact_cache)
        if not mitogen_installed():
            print("mitogen: not installed (make install-mitogen); its run is skipped", flush=True)
        else:
            # The way `make provision MITOGEN=1` runs it.
            label = "idempotent site.yml (tuned + mitogen_linear)"
            env = {"VENV_PYTHON": sys.executable}
            results["mitogen"] = run_site(label, env, fact_cache, prefix=(str(WITH_MITOGEN),))
        converged = "idempotent site.yml, converged check on (tuned)"
        results["converged"] = run_site(converged, {}, fact_cache, extra=CONVERGED)
        label = "idempotent site.yml, converged check on (Ansible defaults)"
        results["converged defaults"] = run_site(label, defaults_env, fact_cache, extra=CONVERGED)
        if mitogen_installed():
            label = "idempotent site.yml, converged check on (tuned + mitogen)"
            env = {"VENV_PYTHON": sys.executable}
            results["converged mitogen"] = run_site(
                label, env, fact_cache, prefix=(str(WITH_MITOGEN),), extra=CONVERGED
            )
        if args.each:
            for name, env_changes in SETTINGS.items():
                results[name] = run_site(f"idempotent, without {name}", env_changes, fact_cache)
        set_status("up")
    print()
    if "cold" in results:
        print(f"cold / idempotent (tuned):        {results['cold'] / results['idempotent']:.2f}x")
        print(f"cold: defaults / tuned:           {results['cold defaults'] / results['cold']:.2f}x")
    print(f"idempotent: defaults / tuned:     {results['defaults'] / results['idempotent']:.2f}x")
    if "mitogen" in results:
        print(f"idempotent: tuned / tuned + mitogen: {results['idempotent'] / results['mitogen']:.2f}x")
    skip = results["converged"]
    print(f"idempotent: every role / converged check (tuned): {results['idempotent'] / skip:.2f}x")
    if "converged mitogen" in results:
        print(f"converged check: tuned / tuned + mitogen: {skip / results['converged mitogen']:.2f}x")
    for name in SETTINGS:
        if name in results:
            print(f"  {name}: saves {results[name] - results['idempotent']:+.1f} s per idempotent run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
