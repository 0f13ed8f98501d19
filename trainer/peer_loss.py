"""The words of a rank whose collective broke because a peer went away: a consequence, not a cause.

Shared by the trainer (which says so in its exit record instead of printing a traceback) and the
launcher (which orders failures across nodes and labels these as what followed the first cause).
gloo and NCCL say it in these ways when the process at the other end died or its node vanished.
"""

from __future__ import annotations

import re

PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"Socket Timeout|Connection refused|DistNetworkError|failed to recv|RendezvousClosedError|"
    r"No route to host|remote process exited|NCCL communicator was aborted",
    re.IGNORECASE,
)


def is_peer_loss(text: str) -> bool:
    return bool(PEER_LOST.search(text))
