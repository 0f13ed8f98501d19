"""scripts/testbed/sshd_finder.py: the sshd of the simulated nodes and of the local sshd tests, found on a
machine without openssh-server installed (unpacked from its .deb), with what an unpacked sshd needs
(its libraries, its helpers in newer OpenSSH, sftp, its privilege separation user); and, where none
is found, a reason that names the fix (the scale tests' skip message)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.local_sshd import sshd_finder

NEEDS_DPKG_DEB = pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="builds a .deb with dpkg-deb")


def build_deb(tmp_path: Path, name: str, files: dict[str, str]) -> Path:
    """A real .deb holding `files` (path inside the package: content; executables)."""
    tree = tmp_path / f"{name}-tree"
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: 1:9.9p1-1\nArchitecture: all\nMaintainer: t <t@t>\nDescription: t\n"
    )
    for inside, content in files.items():
        path = tree / inside
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        path.chmod(0o755)
    deb = tmp_path / "archives" / f"{name}_9.9p1-1_all.deb"
    deb.parent.mkdir(exist_ok=True)
    subprocess.run(["dpkg-deb", "--build", str(tree), str(deb)], check=True, capture_output=True)
    return deb


def test_without_any_sshd_the_reason_names_the_fix(tmp_path):
    reason = sshd_finder.missing(env={"PATH": ""}, installed_dirs=(), archives=tmp_path)
    assert reason is not None
    assert "apt-get install --download-only openssh-server" in reason, reason
    assert sshd_finder.SSHD_ENV in reason and str(tmp_path) in reason, reason


def test_an_sshd_on_path_is_used_as_it_is(tmp_path):
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    (sbin / "sshd").write_text("#!/bin/sh\n")
    (sbin / "sshd").chmod(0o755)
    found = sshd_finder.locate(env={"PATH": ""}, installed_dirs=(str(sbin),), archives=tmp_path)
    assert found == sbin / "sshd"
    assert sshd_finder.missing(env={"PATH": ""}, installed_dirs=(str(sbin),), archives=tmp_path) is None


@NEEDS_DPKG_DEB
def test_the_package_in_apt_s_cache_is_found_and_the_env_var_overrides_an_installed_sshd(tmp_path):
    deb = build_deb(tmp_path, "openssh-server", {"usr/sbin/sshd": "#!/bin/sh\n"})
    archives = deb.parent
    assert sshd_finder.locate(env={"PATH": ""}, installed_dirs=(), archives=archives) == deb
    # An installed sshd comes before the cache; the variable comes before both (how the unpacked one
    # is proven on a machine that has one installed).
    sbin = tmp_path / "sbin"
    sbin.mkdir()
    (sbin / "sshd").write_text("#!/bin/sh\n")
    (sbin / "sshd").chmod(0o755)
    installed = (str(sbin),)
    assert sshd_finder.locate(env={"PATH": ""}, installed_dirs=installed, archives=archives) == sbin / "sshd"
    given = {sshd_finder.SSHD_ENV: str(deb), "PATH": ""}
    assert sshd_finder.locate(env=given, installed_dirs=installed, archives=archives) == deb


@NEEDS_DPKG_DEB
def test_an_unpacked_newer_sshd_is_pointed_at_its_helpers_and_its_libraries(tmp_path):
    # OpenSSH 9.8 and later run sshd-session per connection, from /usr/lib/openssh unless told:
    # not there on a machine without the package.
    server = build_deb(
        tmp_path,
        "openssh-server",
        {
            "usr/sbin/sshd": '#!/bin/sh\necho "libs=$LD_LIBRARY_PATH args=$*"\n',
            "usr/lib/openssh/sshd-session": "#!/bin/sh\n",
        },
    )
    build_deb(tmp_path, "libwrap0", {"usr/lib/x86_64-linux-gnu/libwrap.so.0": ""})
    into = tmp_path / "unpack"
    into.mkdir()
    sshd = sshd_finder.prepare(server, into, archives=tmp_path / "nowhere")
    unpacked = into / "unpacked"
    assert sshd.binary == str(unpacked / "usr/sbin/sshd")
    assert f"SshdSessionPath {unpacked}/usr/lib/openssh/sshd-session" in sshd.config_lines
    assert not any(line.startswith("SshdAuthPath") for line in sshd.config_lines), "no sshd-auth here"
    assert "Subsystem sftp internal-sftp" in sshd.config_lines, "sftp-server is another package"
    ran = subprocess.run([sshd.path, "-f", "cfg"], capture_output=True, text=True, check=True).stdout
    assert ran.strip() == f"libs={unpacked}/usr/lib/x86_64-linux-gnu args=-f cfg"


@NEEDS_DPKG_DEB
def test_debian_12_s_sshd_gets_no_keyword_it_would_refuse(tmp_path):
    # sshd 9.2 exits on an unknown keyword such as SshdSessionPath.
    server = build_deb(tmp_path, "openssh-server", {"usr/sbin/sshd": "#!/bin/sh\n"})
    sshd = sshd_finder.prepare(server, tmp_path, archives=tmp_path / "nowhere")
    assert sshd.config_lines == ("Subsystem sftp internal-sftp",)
    assert sshd.path == sshd.binary, "no libraries unpacked: no wrapper"


def test_the_privilege_separation_user_is_added_only_where_missing():
    fresh = "root:x:0:0:root:/root:/bin/bash\n"
    added = sshd_finder.passwd_with_privsep_user(fresh)
    assert added.startswith(fresh) and added.splitlines()[-1].split(":")[0] == "sshd"
    assert sshd_finder.passwd_with_privsep_user(added) is None
