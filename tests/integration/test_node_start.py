"""Waiting for the nodes ends with one error that says why: a launched process that exits
ends the wait at once (with its exit status and stderr), a timeout names who came."""

from __future__ import annotations

import asyncio
import os

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
    assert "  | error: argument --heartbeat-interval: invalid float value: 'soon'" in message
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


def test_a_stopped_node_whose_teardown_blocks_still_exits(tmp_path, capfd):
    """A node stops when its controller stays silent (here: it holds another secret). A
    teardown that then blocks for good (the event loop's close waits forever here, as a
    third-party finalizer once did on a lock held by a killed process) does not keep the
    process alive: it ends, status 1 (it never reached its controller), after its grace period,
    and says so."""
    # Imported by the node's interpreter at start-up (PYTHONPATH comes before site-packages).
    (tmp_path / "sitecustomize.py").write_text(
        "import asyncio, threading\nasyncio.Runner.close = lambda self: threading.Event().wait()\n"
    )
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)

    async def main() -> int:
        kw = {"heartbeat_interval": 0.3, "heartbeat_timeout": 1.5}
        async with Controller(Security(new_secret()), **kw) as ctl:
            env = {"OMP_NUM_THREADS": "1", "ARL_LOG_LEVEL": "INFO", "PYTHONPATH": path}
            async with LocalNodes(
                ctl.address, Security(new_secret()), [env], node_ids=["stuck"], **kw
            ) as nodes:
                return await asyncio.wait_for(nodes.procs[0].wait(), 90)

    assert asyncio.run(main()) == 1
    err = capfd.readouterr().err
    assert "node stuck stopping: controller silent" in err, err[-2000:]
    assert "node stuck: not exited 10 s after it stopped; ending the process" in err, err[-2000:]
