"""Errors that cross the wire: the table of remote error kinds, the ``err`` body, `RemoteError`.

A node answers a failed call with ``{type, kind, message, traceback}`` (`error_payload`). The
``kind`` is one row of `ErrorKind`: what the failure means and whether a fresh cluster may get
past it (``recoverable``). An exception class opts into a kind with a class attribute
``error_kind = ErrorKind.X``; any other exception is `ErrorKind.ERROR`. The caller re-raises the
reply as `RemoteError` and tells failures apart by ``err.kind`` (or ``err.recoverable``), never
by the remote type's name, which is there for people to read.
"""

from __future__ import annotations

import enum
import traceback
from typing import Any


class ErrorKind(enum.Enum):
    """The remote error kinds: each a wire name, a meaning, and whether a restart may help."""

    SERVER_EXITED = (
        "server_exited",
        "the node's inference server process died (killed, crashed, out of memory); the node "
        "leaves, and a fresh cluster starts a new server",
        True,
    )
    SERVER_START = (
        "server_start",
        "the node's inference server did not start (not installed, a bad argument, too little "
        "memory, too slow); its log's last lines in the message say why, and the same config "
        "would fail again",
        False,
    )
    PEER_LOST = (
        "peer_lost",
        "a node this node pulled data from is gone: it closed its connection (died or "
        "restarted) or stayed silent past the pull timeout; a fresh cluster starts it again",
        True,
    )
    GROUP_TIMEOUT = (
        "group_timeout",
        "a prompt group ran longer than rollout.group_timeout and was abandoned on its node",
        False,
    )
    IMPORT_REFUSED = (
        "import_refused",
        "an import string is outside cluster.allowed_import_prefixes (the same config would "
        "be refused again)",
        False,
    )
    MALFORMED = (
        "malformed",
        "a message or value that does not have the shape the protocol promises",
        False,
    )
    ERROR = (
        "error",
        "an exception raised by code on the node (a bug, bad data, a full disk): it would "
        "happen again",
        False,
    )

    def __init__(self, wire: str, meaning: str, recoverable: bool):
        self.wire, self.meaning, self.recoverable = wire, meaning, recoverable

    @classmethod
    def from_wire(cls, name: Any) -> ErrorKind:
        """The kind named ``name``; an unknown or missing one reads as `ERROR` (not
        recoverable: a failure nobody can classify must not trigger restarts)."""
        return _BY_WIRE.get(name, cls.ERROR) if isinstance(name, str) else cls.ERROR


_BY_WIRE = {k.wire: k for k in ErrorKind}


def kind_of(exc: BaseException) -> ErrorKind:
    """The kind an exception declares (``error_kind`` on its class or a base), else `ERROR`."""
    kind = getattr(type(exc), "error_kind", None)
    return kind if isinstance(kind, ErrorKind) else ErrorKind.ERROR


def error_payload(exc: BaseException) -> dict:
    """The ``err`` reply body: the exception's type, kind, message and formatted traceback."""
    return {
        "type": type(exc).__name__,
        "kind": kind_of(exc).wire,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
    }


class RemoteError(RuntimeError):
    """An exception raised on a node, re-raised on the caller with the remote traceback."""

    def __init__(
        self,
        node: str,
        method: str,
        type_name: str,
        message: str,
        tb: str,
        kind: ErrorKind = ErrorKind.ERROR,
    ):
        self.node, self.method, self.kind = node, method, kind
        self.type_name, self.remote_message, self.remote_traceback = type_name, message, tb
        super().__init__(
            f"{type_name} on node {node} in {method}: {message}\n--- remote traceback ---\n{tb}"
        )

    @property
    def summary(self) -> str:
        """The failure without the remote traceback: for a classified kind (not `ERROR`), whose
        message says what happened, the traceback only shows the node's internals."""
        return f"{self.type_name} on node {self.node} in {self.method}: {self.remote_message}"

    @property
    def recoverable(self) -> bool:
        """Whether a fresh cluster may get past this failure (the kind's table row says)."""
        return self.kind.recoverable

    @classmethod
    def from_payload(cls, node: str, method: str, payload: Any) -> RemoteError:
        """The error an ``err`` reply describes (a body that is not a map reads as empty)."""
        a = payload if isinstance(payload, dict) else {}
        return cls(
            node,
            method,
            str(a.get("type", "Error")),
            str(a.get("message", "")),
            str(a.get("traceback", "")),
            ErrorKind.from_wire(a.get("kind")),
        )
