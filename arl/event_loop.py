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


# The tasks `run_loop` runs now, for `cancel_running` (a signal handler's way in).
_running: list[asyncio.Task] = []


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a new event loop (uvloop when installed) and return its
    result, as `asyncio.run` does."""

    async def main() -> T:
        task = asyncio.current_task()
        assert task is not None
        _running.append(task)
        try:
            return await coro
        finally:
            _running.remove(task)

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())


def cancel_running() -> bool:
    """Cancel what `run_loop` runs now, as asyncio's Ctrl-C handler cancels its main task, so
    that its ``finally`` blocks run on a live loop; call it from a signal handler in the main
    thread. `run_loop` then raises `asyncio.CancelledError`. False when nothing runs."""
    for task in _running:
        if not task.done():
            task.cancel()
            task.get_loop().call_soon_threadsafe(lambda: None)  # wake the loop to see it
            return True
    return False
