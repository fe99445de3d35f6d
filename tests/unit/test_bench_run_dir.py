"""`fresh_run_dir`: a benchmark replaces only the run folders benchmarks made."""

from __future__ import annotations

import pytest

from arl.bench import BENCH_MARK, fresh_run_dir
from arl.config import ConfigError


def test_a_benchmarks_own_folder_is_replaced_and_marked(tmp_path) -> None:
    run = tmp_path / "runs" / "loop"
    fresh_run_dir(run)  # new
    (run / "metrics.jsonl").write_text("{}\n")
    fresh_run_dir(run)  # made by a benchmark: emptied
    assert sorted(p.name for p in run.iterdir()) == [BENCH_MARK]


def test_an_empty_folder_is_used_and_anything_else_refused_untouched(tmp_path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    fresh_run_dir(empty)
    assert (empty / BENCH_MARK).is_file()
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"user already holds files and no .arl-bench marker"):
        fresh_run_dir(user)
    assert [p.name for p in user.iterdir()] == ["notes.txt"]
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError):
        fresh_run_dir(a_file)
    assert a_file.read_text() == "x"
