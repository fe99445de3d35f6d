"""The restart supervisor: runs `arl.run.run` and, with ``recover.mode=auto``, starts it again
from the last recovery checkpoint after a failure a fresh cluster may get past.

A restart reuses the run directory, its lock, the run id, the loaded data and the placement
plan; at most ``recover.retries`` restarts. An error that would happen again (a bug, bad data,
code that blocked a node's event loop) is not retried. This module never imports the CLI.
"""

from __future__ import annotations

import sys

from arl.ckpt.recovery import CheckpointError
from arl.ckpt.stop import StopRequest
from arl.config import Config
from arl.control.controller import NodeLost, NodesNotStarted, RemoteError
from arl.control.rollout import RolloutFailed
from arl.control.workers import CallTimeout
from arl.event_loop import run_loop
from arl.protocol.errors import ErrorKind
from arl.protocol.plan import Plan
from arl.run import run


def supervise(
    cfg: Config,
    plan: Plan,
    run_id: str | None = None,
    data: tuple[list[dict], list[dict]] | None = None,
    stop: StopRequest | None = None,
) -> int:
    """Run the experiment on ``plan``, restarting it when ``recover.mode=auto`` allows; returns
    the exit status (0 done, 1 stopped by an error, which is printed). A ``stop`` ends it with
    a checkpoint: `arl.ckpt.stop.RunStopped` propagates, never restarted."""
    restarts = 0
    while True:
        try:
            run_loop(run(cfg, plan, run_id=run_id, data=data, stop=stop))
            return 0
        except (
            NodesNotStarted,
            NodeLost,
            RolloutFailed,
            CallTimeout,
            RemoteError,
            CheckpointError,
        ) as e:
            # The cluster is down by now (every process of the attempt was ended).
            if stop is not None and stop.requested:  # failed while stopping: never restarted
                print(f"error: the run stopped: {_described(e)}", file=sys.stderr)
                stop.done()
                return 128 + stop.signum
            why_not = _why_not_restart(cfg, e, restarts)
            if why_not is not None:
                print(f"error: the run stopped: {_described(e)}", file=sys.stderr)
                if why_not:
                    print(why_not, file=sys.stderr)
                return 1
            restarts += 1
            print(
                f"recovery: this attempt stopped: {_described(e)}\nrecovery: restarting the run "
                f"from its last checkpoint (restart {restarts} of at most {cfg.recover.retries})",
                file=sys.stderr,
            )


def _why_not_restart(cfg: Config, exc: BaseException, restarts: int) -> str | None:
    """None when the run restarts after ``exc``; else the line saying why not ("" with
    recovery off)."""
    if cfg.recover.mode != "auto":
        return ""
    if not recoverable(exc):
        return (
            "recovery: not restarting (this error would happen again); once it is fixed, run "
            "the same command to resume from the last checkpoint"
        )
    if restarts >= cfg.recover.retries:
        return (
            f"error: giving up after {restarts} restart(s) (recover.retries={cfg.recover.retries})"
        )
    return None


def _described(exc: BaseException) -> str:
    """What the user reads: a classified remote failure (a server that did not start, a lost
    peer) without the node's traceback, which an unclassified or malformed one (a bug in a
    workflow or in arl) keeps: the node logs no traceback of its own."""
    if isinstance(exc, RemoteError) and exc.kind not in (ErrorKind.ERROR, ErrorKind.MALFORMED):
        return exc.summary
    return str(exc)


def recoverable(exc: BaseException) -> bool:
    """Whether a fresh cluster may get past ``exc``: a node that died, stopped answering, or
    hung in a call is worth a restart; an exception raised by code (a bug, bad data, a full
    disk), or a node whose event loop code blocked (its watchdog named it), would only happen
    again."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, NodeLost) and seen.blocked_in:  # code blocked its event loop
            return False
        if isinstance(seen, NodeLost | CallTimeout):
            return True
        if isinstance(seen, RemoteError) and seen.recoverable:  # e.g. its inference server died
            return True
        seen = seen.__cause__
    return False
