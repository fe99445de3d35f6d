"""The remote error table: each kind's wire name and recoverable flag, the err body, RemoteError."""

from __future__ import annotations

import pytest

from arl.engines.server import ServerExited, ServerStartError
from arl.node.data_plane import OwnerLost, ShardUnavailable
from arl.node.rollout import GroupTimeout
from arl.protocol.errors import ErrorKind, RemoteError, error_payload, kind_of
from arl.protocol.imports import ImportRefused
from arl.protocol.rtensor import RTensorError
from arl.supervisor import _described, recoverable
from arl.wire.codec import WireError


def test_every_kind_has_a_unique_wire_name_a_meaning_and_a_flag() -> None:
    names = [k.wire for k in ErrorKind]
    assert len(set(names)) == len(names)
    for k in ErrorKind:
        assert k.meaning and isinstance(k.recoverable, bool)
        assert ErrorKind.from_wire(k.wire) is k
    # Only a dead inference server or a dead data owner is worth a fresh cluster; code errors
    # would repeat.
    assert [k for k in ErrorKind if k.recoverable] == [ErrorKind.SERVER_EXITED, ErrorKind.PEER_LOST]


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (ServerExited("vllm exited"), ErrorKind.SERVER_EXITED),
        (ServerStartError("vllm exited before it became healthy"), ErrorKind.SERVER_START),
        (GroupTimeout("too long"), ErrorKind.GROUP_TIMEOUT),
        (OwnerLost("rollout0", "g1", "closed the connection"), ErrorKind.PEER_LOST),
        (ShardUnavailable("rollout0", "g1", "not held (freed?)"), ErrorKind.ERROR),
        (ImportRefused("no"), ErrorKind.IMPORT_REFUSED),
        (WireError("bad frame"), ErrorKind.MALFORMED),
        (RTensorError("bad ref"), ErrorKind.MALFORMED),
        (ValueError("a bug"), ErrorKind.ERROR),
        (TimeoutError("a reward's own timeout"), ErrorKind.ERROR),
    ],
)
def test_exceptions_declare_their_kind_and_it_survives_the_payload(exc, kind) -> None:
    assert kind_of(exc) is kind
    payload = error_payload(exc)
    assert payload["type"] == type(exc).__name__ and payload["kind"] == kind.wire
    err = RemoteError.from_payload("node3", "rollout.run_group", payload)
    assert err.kind is kind and err.recoverable is kind.recoverable
    assert err.type_name == type(exc).__name__ and err.remote_message == str(exc)
    assert "node node3 in rollout.run_group" in str(err)


@pytest.mark.parametrize(
    "payload",
    [None, [], {}, {"kind": "no_such_kind"}, {"kind": 7}, {"type": "ServerExited"}],
)
def test_an_unknown_or_missing_kind_reads_as_a_non_recoverable_error(payload) -> None:
    err = RemoteError.from_payload("n", "m", payload)
    assert err.kind is ErrorKind.ERROR and not err.recoverable


def test_the_restart_decision_follows_the_kind_not_the_type_name() -> None:
    dead = RemoteError.from_payload("n", "m", error_payload(ServerExited("gone")))
    assert recoverable(dead)
    # A remote type merely *named* ServerExited, without the kind, is not a dead server.
    named = RemoteError("n", "m", "ServerExited", "x", "", ErrorKind.ERROR)
    assert not recoverable(named)
    wrapped = RuntimeError("rollout stopped")
    wrapped.__cause__ = dead
    assert recoverable(wrapped)


def test_a_pull_from_a_dead_owner_is_worth_a_restart_and_a_missing_shard_is_not() -> None:
    # The rank's pull fails before the controller declares the owner lost, so the kind alone
    # must carry the verdict: the supervisor restarts what a fresh cluster may fix.
    lost = error_payload(OwnerLost("rollout0", "g1", "the owner closed the connection"))
    assert recoverable(RemoteError.from_payload("train0", "train.ppo_update", lost))
    freed = error_payload(ShardUnavailable("rollout0", "g1", "not held by this node"))
    assert not recoverable(RemoteError.from_payload("train0", "train.ppo_update", freed))


def test_a_classified_failure_is_reported_without_the_remote_traceback():
    payload = error_payload(ServerStartError("vllm exited with code 1 before it became healthy"))
    started = RemoteError.from_payload("rollout0", "rollout.setup", payload)
    assert _described(started) == (
        "ServerStartError on node rollout0 in rollout.setup: vllm exited with code 1 before it "
        "became healthy"
    )
    bug = RemoteError.from_payload("rollout0", "rollout.setup", error_payload(ValueError("x")))
    assert "\n--- remote traceback ---\n" in _described(bug)  # a bug keeps where it was


def test_a_malformed_report_keeps_the_remote_traceback_the_node_never_logged():
    from arl.protocol.report import ReportError

    payload = error_payload(ReportError("workflow returned rewards of the wrong length"))
    bad = RemoteError.from_payload("rollout0", "rollout.run_group", payload)
    assert bad.kind is ErrorKind.MALFORMED
    assert "\n--- remote traceback ---\n" in _described(bad)
