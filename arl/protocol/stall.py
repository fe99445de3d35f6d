"""A node's event-loop stall report: where the blocked loop is, and who may send it.

The node's watchdog thread sends it over a socket of its own whose routing id is
`watchdog_identity`; the controller accepts it only from that identity, for a node that said
hello with the same pid.
"""

from __future__ import annotations

import sys
import sysconfig
import traceback

_LIBRARY_DIRS = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


def watchdog_identity(node_id: str) -> bytes:
    """The routing id of a node's watchdog socket (the controller checks it)."""
    return f"{node_id}/watchdog".encode()


def stall_report(thread_id: int, blocked: float) -> dict:
    """Where thread ``thread_id`` is now: its innermost frame outside the standard library and
    installed packages (the code that blocks), and its whole stack."""
    frame = sys._current_frames().get(thread_id)
    frames = traceback.extract_stack(frame) if frame is not None else []
    own = [f for f in frames if not f.filename.startswith(_LIBRARY_DIRS)]
    top = (own or frames or [None])[-1]
    where = "an unknown place"
    if top is not None:
        where = f"{top.name} at {top.filename}:{top.lineno}"
        if top.line:
            where += f" ({top.line.strip()})"
    return {
        "seconds": round(blocked, 1),
        "where": where,
        "stack": "".join(traceback.format_list(frames)),
    }
