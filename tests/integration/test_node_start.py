"""Waiting for the nodes ends with one error that says why: a launched process that exits
ends the wait at once (with its exit status and stderr), a timeout names who came."""

from __future__ import annotations

import asyncio

import pytest

from arl.control.controller import Controller, NodesNotStarted
from arl.control.launcher import LocalNodes
from arl.wire.sockets import Security, new_secret


def test_a_node_process_that_exits_at_once_ends_the_wait_with_its_status_and_stderr(capfd):
    """A real node command given a bad argument exits at once (argparse, status 2): the wait
    ends then, not at its timeout, and the error carries the node's own stderr lines."""

    async def main() -> tuple[str, str]:
        security = Security(new_secret())
        async with Controller(security) as ctl:
            envs = [{"OMP_NUM_THREADS": "1"}] * 2
            # A value the daemon's argument parser refuses.
            async with LocalNodes(ctl.address, security, envs, heartbeat_interval="soon") as nodes:
                with pytest.raises(NodesNotStarted) as err:
                    await ctl.wait_for_nodes(2, timeout=3600, stop_if=nodes.exited)
            return ctl.address, str(err.value)

    address, message = asyncio.run(main())
    assert message.startswith(f"0 of 2 nodes connected to {address} before node process node")
    assert "exited with code 2; the last lines of its stderr:" in message
    assert "  | arl-node: error: argument --heartbeat-interval: invalid float value: 'soon'" in (
        message
    )
    # The node's stderr still reached ours as it was written.
    assert "invalid float value: 'soon'" in capfd.readouterr().err


def test_a_timeout_names_the_nodes_that_came_and_from_where():
    async def main() -> tuple[str, str]:
        security = Security(new_secret())
        async with Controller(security, heartbeat_timeout=60) as ctl:
            envs = [{"OMP_NUM_THREADS": "1"}]
            async with LocalNodes(ctl.address, security, envs, node_ids=["only"]) as nodes:
                await ctl.wait_for_nodes(1, timeout=300, stop_if=nodes.exited)
                with pytest.raises(NodesNotStarted) as err:
                    await ctl.wait_for_nodes(2, timeout=0.5, stop_if=nodes.exited, hint="do X")
            return ctl.address, str(err.value)

    address, message = asyncio.run(main())
    assert message.startswith(f"1 of 2 nodes connected to {address} (only from ")
    assert message.endswith(" within 0.5s; do X")
