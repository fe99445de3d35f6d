"""Rules known before launch are checked by validation, not found at step 1 (issue 19)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from arl.config import Config, ConfigError, apply_overrides

REPO = Path(__file__).resolve().parents[2]


def test_fewer_prompt_groups_than_train_ranks_is_refused():
    cfg = apply_overrides(Config(), ["actor.backend=fsdp:d3", "data.batch_size=1"])
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    line = next(ln for ln in str(info.value).splitlines() if "data.batch_size" in ln)
    assert line.strip().startswith("data.batch_size=1: fewer prompt groups than the 3 train ranks")
    assert "data.batch_size >= 3" in line


@pytest.mark.parametrize("batch", [3, 4, 6])
def test_as_many_groups_as_train_ranks_or_more_is_fine(batch):
    cfg = apply_overrides(Config(), ["actor.backend=fsdp:d3", f"data.batch_size={batch}"])
    cfg.validate()  # raises ConfigError if the rule refused it
    assert cfg.data.batch_size == batch


def test_dry_run_refuses_it_before_any_process():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "arl.launch",
            "recipes/arith.py",
            "actor.backend=fsdp:d3",
            "data.batch_size=1",
            "--dry-run",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2, res.stderr
    assert "data.batch_size=1: fewer prompt groups than the 3 train ranks" in res.stderr
