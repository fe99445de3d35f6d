"""Benchmarks: ``python -m arl.bench NAME`` (see `arl.bench.__main__`), and what they share."""

from __future__ import annotations

import shutil
from pathlib import Path

from arl.config import ConfigError

BENCH_MARK = ".arl-bench"  # in every run folder a benchmark made, so a later one may replace it


def fresh_run_dir(path: Path) -> None:
    """Make ``path`` an empty run folder for a benchmark's run.

    A folder an earlier benchmark made (it holds `BENCH_MARK`) is removed first; any other
    folder that is not empty is refused with a `ConfigError`: a benchmark never deletes what it
    did not write.
    """
    if path.exists():
        if path.is_dir() and (path / BENCH_MARK).is_file():
            shutil.rmtree(path)
        elif not path.is_dir() or any(path.iterdir()):
            raise ConfigError(
                f"{path} already holds files and no {BENCH_MARK} marker of a benchmark's run; "
                "a benchmark replaces its run folder on every run, so give it one of its own "
                "(--run-dir, or experiment.name / experiment.trial), or remove this one if it "
                "is an earlier benchmark's (benchmarks of arl before the marker left none)"
            )
    path.mkdir(parents=True, exist_ok=True)
    (path / BENCH_MARK).write_text("made by python -m arl.bench; the next benchmark replaces it\n")
