"""Failures after the nodes start, as a user of ``python -m arl.launch`` sees them: one error,
the run-stopped exit status, no traceback of the node's internals."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vllm is installed in this python"
)
def test_a_server_that_cannot_start_is_one_error_with_its_log_and_no_traceback(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "arl.launch",
            "recipes/arith.py",
            "rollout.backend=vllm:d1",
            f"rollout.server_python={sys.executable}",  # this python, which has no vllm
            f"experiment.run_dir={tmp_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 1, r.stderr[-3000:]  # the run stopped (a runtime failure, not input)
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith(
        "error: the run stopped: ServerStartError on node rollout0 in rollout.setup: vllm "
        "exited with code 1 before it became healthy"
    ), line
    assert "No module named 'vllm'" in r.stderr  # the server log's tail is in the message
    assert "Traceback" not in r.stderr and "remote traceback" not in r.stderr
