"""The tree stays ruff-clean (lint and format, line length 100), as CONVENTIONS asks."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
