"""An interrupted local copy (`trainer push` to a head reached with ansible_connection local) has kept
its half-copied file by the time the push reports the interruption: rsync's first process ends
before the one that holds the file has moved it into the partial dir, so the copy waits for rsync's
whole process group. Interrupted five times at full speed (about a third of them lost the file
when only the first process was waited for)."""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from trainer.controller.rsync_to_host import LOCAL, PARTIAL_DIR, Target, copy

#: Not slow: five copies of 16 MB stopped at 1 MB each.
ALL_SLOW = False

pytestmark = pytest.mark.skipif(shutil.which("rsync") is None, reason="needs rsync")


def test_an_interrupted_local_copy_has_kept_its_partial_file_when_it_returns(tmp_path):
    data = tmp_path / "big.bin"
    data.write_bytes(os.urandom(16_000_000))
    me = getpass.getuser()
    target = Target("here", LOCAL, "", me, me)
    for attempt in range(5):
        destination = tmp_path / f"copy-{attempt}"
        destination.mkdir()
        # SIGINT to this process alone once 1 MB arrived, as TERM to `trainer push` turned into
        # KeyboardInterrupt would come. At 2 MB/s, 7.5 s are left to interrupt it in (at 8 MB/s the
        # copy once ended first in CI's niced queue).
        interrupter = threading.Thread(target=_interrupt_at_1_mb, args=(destination,), daemon=True)
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            copy(target, str(data), f"{destination}/", bwlimit_kib=2000)
        interrupter.join()
        held = sorted(str(path.relative_to(destination)) for path in destination.rglob("*"))
        assert (destination / PARTIAL_DIR / "big.bin").is_file(), f"attempt {attempt}: {held}"
        assert not (destination / "big.bin").exists(), "a half-copied file never sits under its name"


def _interrupt_at_1_mb(destination: Path) -> None:
    while True:
        for path in destination.glob(".big.bin.*"):
            with contextlib.suppress(OSError):
                if path.stat().st_size > 1_000_000:
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                    return
        time.sleep(0.01)
