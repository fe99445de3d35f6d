"""`arl.compile_cache`: torch.compile's on-disk caches under ``ARL_CACHE``, one folder per torch
version, and a user's own inductor settings kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from arl.compile_cache import compile_cache_dir, use_compile_cache

_ENV = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_FX_GRAPH_CACHE",
    "TORCHINDUCTOR_AUTOGRAD_CACHE",
    "TRITON_CACHE_DIR",
)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No inductor settings in the environment (restored afterwards); ARL_CACHE in tmp_path."""
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ARL_CACHE", str(tmp_path / "arl"))
    return tmp_path / "arl"


def test_compiled_code_is_kept_under_arl_cache_per_torch_version(clean_env: Path) -> None:
    used = use_compile_cache()
    expected = clean_env / "compile" / f"torch-{torch.__version__}"
    assert used == str(expected) == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert expected.is_dir()
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
    assert os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"
    # Triton kernels launched outside inductor: where inductor keeps device 0's
    assert os.environ["TRITON_CACHE_DIR"] == str(expected / "triton" / "0")
    assert use_compile_cache() == used  # a second call changes nothing


def test_a_torch_upgrade_gets_a_folder_of_its_own(clean_env: Path) -> None:
    cuda = compile_cache_dir(torch_version="2.11.0+cu130")
    assert cuda == clean_env / "compile" / "torch-2.11.0+cu130"
    assert compile_cache_dir(torch_version="2.12.0+cu130") != cuda
    assert compile_cache_dir(torch_version="2.11.0 (odd/build)").name == "torch-2.11.0__odd_build_"


def test_a_users_inductor_settings_are_kept(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mine = tmp_path / "my-inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "my-triton"))
    assert use_compile_cache() == str(mine)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "my-triton")
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0"
    assert not clean_env.exists()  # nothing made under ARL_CACHE
