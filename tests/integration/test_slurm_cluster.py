"""Smoke test of the Slurm cluster itself (CI starts one with `bash .ci/start-slurm`)."""

import shutil
import subprocess

import pytest

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(
        shutil.which("srun") is None,
        reason="srun not on PATH: no Slurm cluster here (start one with `bash .ci/start-slurm`)",
    ),
]


def test_srun_runs_two_tasks():
    """`srun -N1 -n2 hostname` runs two tasks on the one node, so it prints the name twice."""
    out = subprocess.run(
        ["srun", "-N1", "-n2", "hostname"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    assert len(out) == 2, out
    assert out[0] == out[1]
