"""How an arl process runs its asyncio program: on uvloop when it is installed, else asyncio.

uvloop is a dependency, but a machine whose wheels were copied by hand may lack it; the run is
the same on either loop (sockets are driven through `arl.wire.loop_socket.LoopSocket`).
"""

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_name() -> str:
    """``"uvloop"`` when uvloop is importable, else ``"asyncio"``: the loop `run_loop` uses."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a new event loop (uvloop when installed) and return its
    result, as `asyncio.run` does."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
