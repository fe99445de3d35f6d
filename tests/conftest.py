"""Fixtures shared by every test directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

GSM8K_ENV = "ARL_GSM8K"


@pytest.fixture(scope="session")
def gsm8k_dir() -> Path:
    """The real GSM8K copy (train.jsonl, test.jsonl) named by $ARL_GSM8K; skips without it."""
    value = os.environ.get(GSM8K_ENV)
    if not value:
        pytest.skip(f"{GSM8K_ENV} is not set (a directory holding GSM8K train.jsonl, test.jsonl)")
    path = Path(value).expanduser()
    if not (path / "train.jsonl").is_file() or not (path / "test.jsonl").is_file():
        pytest.fail(f"{GSM8K_ENV}={value}: no train.jsonl and test.jsonl there")
    return path
