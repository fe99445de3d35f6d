"""`arl.bytecode`: bytecode kept under the arl cache where Python would not keep it, in fresh
interpreters (the setting is per process and reaches the processes it starts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Runs `cache_bytecode` with a probe package of the test's own, imports it, starts a child that
# imports it again, and reports where each found its bytecode.
SCRIPT = """
import json, os, subprocess, sys
sys.path.insert(0, {src!r})
from arl.bytecode import cache_bytecode
prefix = cache_bytecode(probe="probe_pkg")
import probe_pkg
child = subprocess.run(
    [sys.executable, "-c", "import sys; sys.path.insert(0, {src!r}); import probe_pkg; "
     "print(sys.pycache_prefix, sys.dont_write_bytecode)"],
    capture_output=True, text=True, check=True,
).stdout.split()
print(json.dumps({{"prefix": prefix and str(prefix), "cached": probe_pkg.__cached__,
                  "env": os.environ.get("PYTHONPYCACHEPREFIX"), "child": child}}))
"""


def _run(tmp_path: Path, **env: str) -> dict:
    src = tmp_path / "src"
    (src / "probe_pkg").mkdir(parents=True, exist_ok=True)
    (src / "probe_pkg" / "__init__.py").write_text("VALUE = 1\n")
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE",)}
    full.pop("PYTHONPYCACHEPREFIX", None)
    full.update(ARL_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(REPO), **env)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(src=str(src))],
        capture_output=True,
        text=True,
        env=full,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.splitlines()[-1])


def _beside(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "src" / "probe_pkg").glob("__pycache__/*.pyc"))


def test_bytecode_is_kept_under_the_cache_when_python_would_not_write_it(tmp_path):
    got = _run(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    prefix = tmp_path / "cache" / "pycache"
    assert got["prefix"] == str(prefix)
    assert got["env"] == str(prefix)  # processes it starts use the same folder
    assert got["child"] == [str(prefix), "False"]
    # the bytecode mirrors the source's path below the prefix, and nothing is written beside it
    assert got["cached"].startswith(str(prefix) + os.sep)
    assert Path(got["cached"]).is_file()
    assert _beside(tmp_path) == []
    # a second process finds it, so compiles nothing
    again = _run(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    assert again["cached"] == got["cached"]


def test_python_s_own_caching_is_left_alone_where_it_works(tmp_path):
    got = _run(tmp_path)  # bytecode written beside the source as usual
    assert got["prefix"] is None and got["env"] is None
    assert got["child"] == ["None", "False"]
    assert len(_beside(tmp_path)) == 1
    assert not (tmp_path / "cache" / "pycache").exists()


def test_arl_pycache_0_turns_it_off_and_a_user_prefix_is_kept(tmp_path):
    off = _run(tmp_path, PYTHONDONTWRITEBYTECODE="1", ARL_PYCACHE="0")
    assert off["prefix"] is None and off["env"] is None
    assert off["child"] == ["None", "True"]
    assert not (tmp_path / "cache" / "pycache").exists()
    mine = tmp_path / "mine"
    kept = _run(tmp_path, PYTHONPYCACHEPREFIX=str(mine))
    assert kept["prefix"] == str(mine) and kept["env"] == str(mine)
    assert kept["cached"].startswith(str(mine) + os.sep)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_install_gets_the_cache(tmp_path):
    _run(tmp_path, ARL_PYCACHE="0", PYTHONDONTWRITEBYTECODE="1")  # creates the package only
    pkg = tmp_path / "src" / "probe_pkg"
    pkg.chmod(0o555)
    try:
        got = _run(tmp_path)
    finally:
        pkg.chmod(0o755)
    assert got["prefix"] == str(tmp_path / "cache" / "pycache")
    assert _beside(tmp_path) == []
