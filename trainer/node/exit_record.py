"""Each rank's own exit code and one-line reason, for the launcher's failure report.

torchrun exits 1 whatever its workers' codes were, and names in its summary the first worker it saw
fail, which may be one it terminated itself. So under `trainer launch` (CLUSTERTRAIN_PROGRESS_DIR set
by run.sh) every rank that ends with a non-zero code writes `exit-R.json` beside its progress file:
its code (2 config, 3 data sizing, 74 disk full, 75 GPU fault, 1 anything else), the reason in one
line, whether that reason is a consequence (a collective broke because a peer went away first), and
the time. The launcher orders these records across nodes by time to name the first cause, with its
own code, and labels the rest as consequences (trainer.controller.launcher.failure).

A rank keeps the first reason it notes: what follows from it (a teardown error) does not replace it.
Without CLUSTERTRAIN_PROGRESS_DIR (a run by hand) nothing is written.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from trainer.node.progress import DIRECTORY_VARIABLE
from trainer.safe_files import umask_mode, write_file

#: The reason this rank noted first: (one line, whether it is a consequence of a peer's failure).
_reason: tuple[str, bool] | None = None


def note(message: str, *, consequence: bool = False) -> None:
    """Remember why this rank is about to fail (the first call wins)."""
    global _reason
    if _reason is None:
        first = message.strip().splitlines()[0] if message.strip() else ""
        _reason = (first[:500], consequence)


def write(code: int) -> None:
    """This rank's exit record, when it ends with a non-zero code under `trainer launch`."""
    global _reason
    raw = os.environ.get(DIRECTORY_VARIABLE, "")
    reason, _reason = _reason, None
    if not raw or code == 0:
        return
    rank = int(os.environ.get("RANK", "0"))
    message, consequence = reason or (f"exit code {code}", False)
    record = {
        "rank": rank,
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "code": code,
        "message": message,
        "consequence": consequence,
        "host": socket.gethostname(),
        "time": time.time(),
    }
    directory = Path(raw)
    target = directory / f"exit-{rank}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Exclusively, never through a link (trainer.safe_files): the dir is on the share.
        write_file(target, json.dumps(record), umask_mode())
    except OSError:
        pass  # the launcher falls back to the node's exit code and the log
