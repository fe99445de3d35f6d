"""arl nodes started by a real Slurm (CI starts a one-node cluster with `.ci/start-slurm`)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from arl.control.controller import Controller
from arl.control.launcher import SlurmNodes, node_command
from arl.protocol.proxy import proxy
from arl.wire.sockets import SECRET_ENV, Security, new_secret
from tests.support.objects import Echo

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        shutil.which("srun") is None,
        reason="srun not on PATH: no Slurm cluster here (start one with `bash .ci/start-slurm`)",
    ),
]


async def _exercise(ctl: Controller, n: int) -> list[str]:
    nodes = await ctl.wait_for_nodes(n, timeout=120)
    ids = []
    for node in nodes:
        echo = proxy(Echo, await node.create("tests.support.objects:Echo"))
        assert await echo.echo({"x": [1, 2]}) == {"x": [1, 2]}
        ids.append(node.node_id)
    return ids


def test_attach_mode_job_script_style_srun_arl_node():
    """As in launch/arl.sbatch: `srun arl-node --controller ...`, controller attaches."""

    async def main():
        security = Security(new_secret())
        async with Controller(security, heartbeat_interval=0.3, heartbeat_timeout=5) as ctl:
            cmd = node_command(
                ctl.address,
                allowed_prefixes=("arl.", "tests."),
                heartbeat_interval=0.3,
                heartbeat_timeout=5,
            )
            env = {**os.environ, SECRET_ENV: security.secret, "OMP_NUM_THREADS": "1"}
            srun = await asyncio.create_subprocess_exec(
                "srun",
                "-N1",
                "-n2",
                "--kill-on-bad-exit=1",
                *cmd,
                env=env,
                stdin=subprocess.DEVNULL,
            )
            try:
                ids = await _exercise(ctl, 2)
                # Node ids come from Slurm's job id and task rank.
                assert sorted(i.rsplit("-", 1)[1] for i in ids) == ["0", "1"]
                assert all(i.startswith("slurm") for i in ids)
            finally:
                await ctl.close()  # says bye: the nodes exit and so does the srun step
                rc = await asyncio.wait_for(srun.wait(), 60)
            assert rc == 0

    asyncio.run(main())


def test_slurm_launcher_starts_nodes_with_srun():
    async def main():
        security = Security(new_secret())
        async with Controller(security, heartbeat_interval=0.3, heartbeat_timeout=5) as ctl:
            async with SlurmNodes(
                ctl.address,
                security,
                2,
                srun_args=["-N1"],
                allowed_prefixes=("arl.", "tests."),
                python=sys.executable,
                heartbeat_interval=0.3,
                heartbeat_timeout=5,
            ) as nodes:
                await _exercise(ctl, 2)
                assert nodes.proc is not None and nodes.proc.returncode is None
            assert nodes.proc.returncode is not None  # the step was ended with the block

    asyncio.run(main())


def test_srun_refused_by_slurm_ends_the_launch_at_once_with_its_stderr(tmp_path):
    """srun exits at once when Slurm refuses the step (here: a partition that does not exist;
    outside a cluster: no controller to ask): the launch reports srun's exit and its own
    error lines instead of waiting cluster.node_start_timeout."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "arl.launch",
            "recipes/arith.py",
            "cluster.launcher=slurm",
            "cluster.srun_args=[--partition=arl-no-such-partition]",
            "cluster.node_start_timeout=3600",
            f"experiment.run_dir={tmp_path}",
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1, r.stderr[-2000:]
    assert "error: the run stopped: 0 of 2 nodes connected to tcp://" in r.stderr
    assert " before srun (pid " in r.stderr and "exited with code " in r.stderr
    assert "  | srun: error: " in r.stderr  # srun's own words, in the error
    assert "Traceback" not in r.stderr
