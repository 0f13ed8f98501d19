"""The access real clusters ask for: a sudo password on the nodes, a vault password for the inventory.

`trainer launch`, `trainer preflight` and `trainer plan` take::

    --ask-become-pass            prompt once for the sudo ("become") password
    --become-password-file FILE  read it from FILE (or ANSIBLE_BECOME_PASSWORD_FILE, as ansible-playbook)
    --vault-password-file FILE   decrypt vaulted inventory variables (or ANSIBLE_VAULT_PASSWORD_FILE)

Where each secret goes, and where it never goes:
- password files: only their paths travel, as ansible-playbook's own options (ansible-runner keeps the
  command line in its private dir); ansible-playbook reads the file itself;
- a typed sudo password: kept in this process's memory. ansible-playbook runs with --ask-become-pass
  and ansible-runner answers its prompt through the pseudo-terminal (pexpect). The answer is handed
  to ansible-runner's config in memory just before the process starts (runner.py): given the usual
  way, ansible-runner would write it to env/passwords in its private dir;
- vaulted variables: decrypted in memory by the controller's inventory loader (inventory.py) with the
  same password files, and by ansible-playbook on its own. Connection secrets (ansible_password,
  ansible_become_password, ...) are never rendered by the loader at all.
So no password is ever on a command line, in an environment variable or in a file this tool writes.
`trainer plan` touches no host: it reads the vault options and never asks for the sudo password.
"""

from __future__ import annotations

import argparse
import getpass
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: ansible-playbook's prompt for --ask-become-pass (AGNOSTIC_BECOME_PROMPT, the default since 2.8; the
#: method's own name otherwise), as a regular expression ansible-runner matches on its output.
BECOME_PROMPT = r"^(BECOME|SUDO|SU|DOAS|PBRUN|PFEXEC|RUNAS|DZDO|KSU|MACHINECTL) password.*:\s*?$"

#: Host variables that hold connection secrets: the controller's loader never renders them.
CONNECTION_SECRETS = frozenset(
    {
        "ansible_password",
        "ansible_ssh_pass",
        "ansible_ssh_password",
        "ansible_become_password",
        "ansible_become_pass",
        "ansible_sudo_pass",
        "ansible_sudo_password",
        "ansible_su_pass",
        "ansible_su_password",
        "ansible_ssh_private_key_passphrase",
    }
)


class AccessError(ValueError):
    """A password option cannot be used; the message names the option, the file and the fix.
    The inventory loader raises it as an InventoryError (exit 2), before any host is touched."""


@dataclass
class Access:
    """The passwords one command may need, by reference (files) or typed once (become)."""

    ask_become_pass: bool = False
    become_password_file: Path | None = None
    vault_password_files: tuple[Path, ...] = ()
    #: Who asks for the typed password (a test gives its own); getpass.getpass by default.
    prompt: Any = field(default=None, repr=False)
    _become_password: str | None = field(default=None, repr=False)
    _checked: bool = field(default=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def check(self, environ: Mapping[str, str] | None = None) -> None:
        """Every password file exists and no other account can read or swap it; the paths become
        absolute (ansible-playbook runs in another directory). Raises AccessError with the fix."""
        if self._checked:
            return
        environ = os.environ if environ is None else environ
        if self.become_password_file is not None:
            self.become_password_file = _checked_file(self.become_password_file, "--become-password-file")
        self.vault_password_files = tuple(
            _checked_file(path, "--vault-password-file") for path in self.vault_password_files
        )
        # The settings ansible-playbook reads by itself are held to the same rule.
        for name in ("ANSIBLE_BECOME_PASSWORD_FILE", "ANSIBLE_VAULT_PASSWORD_FILE"):
            if environ.get(name):
                _checked_file(Path(environ[name]), name)
        self._checked = True

    def become_password(self) -> str | None:
        """The typed sudo password, asked once (on first use) when --ask-become-pass was given."""
        if not self.ask_become_pass:
            return None
        with self._lock:
            if self._become_password is None:
                ask = self.prompt or getpass.getpass
                self._become_password = ask("BECOME password: ")
            return self._become_password

    def cmdline(self) -> list[str]:
        """ansible-playbook options for these passwords: paths and flags only, never a password."""
        self.check()
        args: list[str] = []
        if self.ask_become_pass:
            args.append("--ask-become-pass")
        elif self.become_password_file is not None:
            args += ["--become-password-file", str(self.become_password_file)]
        for path in self.vault_password_files:
            args += ["--vault-password-file", str(path)]
        return args

    def expect_passwords(self) -> dict[str, str]:
        """Prompt pattern -> answer, for ansible-runner's pexpect loop (empty without a typed password)."""
        password = self.become_password()
        return {BECOME_PROMPT: password} if password is not None else {}


_current = Access()


def current() -> Access:
    """The access this process's command line configured (no passwords when none was given)."""
    return _current


def add_access_arguments(parser: argparse.ArgumentParser) -> None:
    """The password options of trainer launch, preflight and plan."""
    group = parser.add_argument_group(
        "passwords",
        "Never on the command line: a password is typed once or read from a file only you can read. "
        "ansible-playbook's own settings ANSIBLE_BECOME_PASSWORD_FILE and ANSIBLE_VAULT_PASSWORD_FILE "
        "work as well.",
    )
    become = group.add_mutually_exclusive_group()
    become.add_argument(
        "-K",
        "--ask-become-pass",
        action="store_true",
        help="ask once for the sudo password of the account Ansible logs in with (ansible_user), "
        "for nodes whose sudo needs one",
    )
    become.add_argument(
        "--become-password-file",
        type=Path,
        metavar="FILE",
        help="read that sudo password from FILE (mode 0600; an executable FILE is run and prints it)",
    )
    add_vault_argument(group)


def add_vault_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--vault-password-file: the one password option of a verb that never asks for sudo's (trainer
    push), and one of trainer launch, preflight and plan's."""
    parser.add_argument(
        "--vault-password-file",
        dest="vault_password_files",
        type=Path,
        action="append",
        default=[],
        metavar="FILE",
        help="password of vaulted inventory variables (ansible-vault), e.g. a vaulted "
        "training_health_webhook_url; repeatable",
    )


def configure_access(args: argparse.Namespace) -> Access:
    """Make the password options of `args` this process's access: every playbook run and the
    inventory loader use it. The files are checked when the inventory is loaded (an error there is
    an inventory error: exit 2, nothing touched)."""
    global _current
    given = Access(
        ask_become_pass=bool(getattr(args, "ask_become_pass", False)),
        become_password_file=getattr(args, "become_password_file", None),
        vault_password_files=tuple(getattr(args, "vault_password_files", None) or ()),
    )
    # The same options again (`trainer up` runs provision, preflight and launch in one process): keep
    # the access already made, so a typed sudo password is asked once, not once per phase.
    if not _same_options(given, _current):
        _current = given
    return _current


def _same_options(one: Access, other: Access) -> bool:
    def absolute(path: Path | None) -> Path | None:
        return None if path is None else Path(os.path.expanduser(str(path))).absolute()

    return (
        one.ask_become_pass == other.ask_become_pass
        and absolute(one.become_password_file) == absolute(other.become_password_file)
        and list(map(absolute, one.vault_password_files)) == list(map(absolute, other.vault_password_files))
    )


def _checked_file(path: Path, option: str) -> Path:
    """An absolute path to a password file that exists and that no other account can read or swap."""
    path = Path(os.path.expanduser(str(path))).absolute()
    try:
        info = path.stat()
    except OSError as err:
        raise AccessError(
            f"{option} {path}: {err.strerror}; give the path of an existing password file"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise AccessError(f"{option} {path} is not a regular file; give the path of a password file")
    executable = bool(info.st_mode & stat.S_IXUSR)
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or (not executable and info.st_mode & stat.S_IROTH):
        what = "changed" if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) else "read"
        raise AccessError(
            f"{option} {path} can be {what} by other accounts (mode {stat.S_IMODE(info.st_mode):04o}); "
            f"fix: chmod {'0700' if executable else '0600'} {path}"
        )
    if not os.access(path, os.R_OK):
        raise AccessError(f"{option} {path} is not readable by this account; fix its owner or mode")
    return path


def vault_secrets(loader: Any, access: Access | None = None) -> list[tuple[str, Any]]:
    """Load the vault passwords (these files, then ANSIBLE_VAULT_PASSWORD_FILE / ansible.cfg) into
    `loader`, an Ansible DataLoader, and into ansible-core's process-wide vault context."""
    from ansible import constants as C
    from ansible.parsing.vault import get_file_vault_secret

    access = access or current()
    access.check()
    files = [str(p) for p in access.vault_password_files]
    if C.DEFAULT_VAULT_PASSWORD_FILE and str(C.DEFAULT_VAULT_PASSWORD_FILE) not in files:
        files.append(str(C.DEFAULT_VAULT_PASSWORD_FILE))
    secrets: list[tuple[str, Any]] = []
    for path in files:
        try:
            secret = get_file_vault_secret(filename=path, vault_id=C.DEFAULT_VAULT_IDENTITY, loader=loader)
            secret.load()
        except Exception as err:  # AnsibleError and friends: name the file, not a traceback
            raise AccessError(f"vault password file {path}: {err}") from None
        secrets.append((C.DEFAULT_VAULT_IDENTITY, secret))
    loader.set_vault_secrets(secrets)
    try:  # ansible-core 2.19+: decryption happens lazily, through one process-wide context
        from ansible.parsing.vault import VaultSecretsContext
    except ImportError:
        return secrets
    context = VaultSecretsContext.current(optional=True)
    if context is None:
        VaultSecretsContext.initialize(VaultSecretsContext(list(secrets)))
    else:  # a second inventory in one process (tests): the context can be set up only once
        context.secrets[:] = secrets
    return secrets


def describe_unrenderable(var: str, error: Exception) -> str:
    """Why a variable could not be rendered, with the fix when the vault is the cause."""
    text = str(error)
    if "vault" in text.lower() or "decrypt" in text.lower():
        files = ", ".join(str(p) for p in current().vault_password_files) or "none given"
        return (
            f"variable {var} is vaulted and cannot be decrypted (vault password files: {files}); fix: pass "
            "--vault-password-file FILE (or set ANSIBLE_VAULT_PASSWORD_FILE) with the password it was "
            "encrypted with"
        )
    return f"variable {var} cannot be rendered: {text}"
