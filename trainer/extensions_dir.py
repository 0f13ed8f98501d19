"""Which directory torch builds and loads this account's JIT extensions (DeepSpeed's ops) in: only one
this account owns, never another account's.

torch loads whatever shared object it finds in TORCH_EXTENSIONS_DIR, and writes its builds there. The
training venv is every account's on a node: trainer_env's .pth file in it calls `use_own_dir()` with
the dir the role builds the ops in as the training user, at every start of the venv's python. Before,
that .pth pointed every account there, root included: root loaded libraries the training account
could have replaced, and root's own builds landed there owned by root. Now each account gets:

1. TORCH_EXTENSIONS_DIR from its own environment (the job's setting), if this account may build there;
2. else the prebuilt dir, if this account owns it (the training account: the role made it so);
3. else torch's own default for this account, `${XDG_CACHE_HOME:-~/.cache}/torch_extensions`, if it
   may build there (sudo -E or `su` can leave HOME at another account's home);
4. else `<its home in the password database>/.cache/torch_extensions`.

"May build there": the dir exists, is a directory (not a link) and is owned by the effective uid; or
it does not exist yet and its nearest existing parent is owned by this account or root and writable
by nobody else (torch makes it as this account; no other account can make it first).

Imports nothing beyond `os` and `stat`, which python has loaded before it reads .pth files: this runs
at every start of the venv's python (every rank of every job).
"""

from __future__ import annotations

import os
import stat


def owned_dir(path: str, euid: int | None = None) -> bool:
    """A directory itself (a link is not followed) owned by `euid` (default: the effective uid)."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == (os.geteuid() if euid is None else euid)


def may_build_in(path: str, euid: int | None = None) -> bool:
    """`path` is this account's dir, or one only this account (or root) could create."""
    euid = os.geteuid() if euid is None else euid
    if not path or not os.path.isabs(path):
        return False
    try:
        os.lstat(path)
    except FileNotFoundError:
        try:
            parent = _nearest_existing(os.path.dirname(path))
        except OSError:
            return False
        return (
            stat.S_ISDIR(parent.st_mode)
            and parent.st_uid in (euid, 0)
            and not parent.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        )
    except OSError:
        return False
    return owned_dir(path, euid)


def _nearest_existing(path: str) -> os.stat_result:
    while True:
        try:
            return os.stat(path)
        except FileNotFoundError:
            if os.path.dirname(path) == path:
                raise
            path = os.path.dirname(path)


def default_dir(environ: dict[str, str] | None = None) -> str:
    """torch's own default (torch._appdirs.user_cache_dir('torch_extensions') on Linux)."""
    environ = os.environ if environ is None else environ
    home = environ.get("HOME") or os.path.expanduser("~")
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")
    return os.path.join(cache, "torch_extensions")


def own_dir(prebuilt: str = "", environ: dict[str, str] | None = None, euid: int | None = None) -> str:
    """The dir this account's torch is to use (the order is in the module's docstring)."""
    environ = os.environ if environ is None else environ
    euid = os.geteuid() if euid is None else euid
    asked = environ.get("TORCH_EXTENSIONS_DIR") or ""
    if asked and may_build_in(asked, euid):
        return asked
    if prebuilt and owned_dir(prebuilt, euid):
        return prebuilt
    default = default_dir(environ)
    if may_build_in(default, euid):
        return default
    import pwd  # only here: a lookup in the password database (LDAP, sssd) may be slow

    return os.path.join(pwd.getpwuid(euid).pw_dir, ".cache", "torch_extensions")


def use_own_dir(prebuilt: str = "") -> None:
    """Set TORCH_EXTENSIONS_DIR for this process and its children (trainer_env's .pth calls this)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = own_dir(prebuilt)
