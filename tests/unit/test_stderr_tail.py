"""`StderrTail`: a node's stderr reaches the launcher's line by line, and a node ended mid-line
(a progress bar cut off) leaves no line for the launcher's own ``error:`` line to continue."""

from __future__ import annotations

import subprocess
import sys

from arl.control.launcher import StderrTail


def test_a_child_ended_mid_line_has_its_line_ended(capsys):
    code = "import sys; sys.stderr.write('whole\\nLoading 43%\\rLoading 57%'); sys.stderr.flush()"
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE)
    tail = StderrTail(child.stderr, "child")
    child.wait(timeout=60)
    tail.close()
    print("error: the run stopped", file=sys.stderr)
    err = capsys.readouterr().err
    assert err == "whole\nLoading 43%\rLoading 57%\nerror: the run stopped\n"
    assert tail.last_lines() == ["whole", "Loading 43%", "Loading 57%"]
