"""The README's embedding example runs as a program, in plain asyncio and under uvloop."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_readme_example_is_the_example_file():
    readme = (REPO / "README.md").read_text()
    assert (REPO / "examples" / "embedded.py").read_text().strip() in readme


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_embedded_example_runs(loop):
    code = (
        "import runpy, sys; sys.argv=['embedded.py'];"
        + ("import uvloop, asyncio; asyncio.run = uvloop.run;" if loop == "uvloop" else "")
        + f"runpy.run_path({str(REPO / 'examples' / 'embedded.py')!r}, run_name='__main__')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "What is" in out.stdout and "rewards: (" in out.stdout  # a GroupReport's tuple
