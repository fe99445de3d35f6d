"""Failures after the nodes start, as a user of ``python -m arl.launch`` sees them: one error,
the run-stopped exit status, no traceback of the node's internals."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_server_that_cannot_start_is_one_error_with_its_log_and_no_traceback(tmp_path):
    # A vllm the launcher's check finds, whose server exits at start (as a broken install, or
    # a GPU it cannot use, would).
    server = tmp_path / "site" / "vllm" / "entrypoints" / "openai"
    server.mkdir(parents=True)
    for folder in (server, server.parent, server.parent.parent):
        (folder / "__init__.py").write_text("")
    (server / "api_server.py").write_text('raise SystemExit("this vllm cannot serve here")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)])}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "arl.launch",
            "recipes/arith.py",
            "rollout.backend=vllm:d1",
            f"rollout.server_python={sys.executable}",
            f"experiment.run_dir={tmp_path / 'runs'}",
        ],
        cwd=REPO,
        env=env,
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
    assert "this vllm cannot serve here" in r.stderr  # the server log's tail is in the message
    assert "Traceback" not in r.stderr and "remote traceback" not in r.stderr
