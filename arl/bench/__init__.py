"""Benchmarks: ``python -m arl.bench NAME`` (see `arl.bench.__main__`), and what they share.

The argparse types below refuse a bad number, or a result file that would replace one already
there, while the command line is parsed (usage, one ``error:`` line, exit 2), before a benchmark
starts a process or writes a file. A benchmark replaces only what a benchmark made: its own run
folders (`fresh_run_dir`, marked with `BENCH_MARK`), never a file a user named.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from arl.config import ConfigError

BENCH_MARK = ".arl-bench"  # in every run folder a benchmark made, so a later one may replace it


def fresh_run_dir(
    path: Path, flag: str = "--run-dir, or experiment.name / experiment.trial"
) -> None:
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
                f"({flag}), or remove this one if it "
                "is an earlier benchmark's (benchmarks of arl before the marker left none)"
            )
    path.mkdir(parents=True, exist_ok=True)
    (path / BENCH_MARK).write_text("made by python -m arl.bench; the next benchmark replaces it\n")


def new_file(text: str) -> Path:
    """An argparse type: where a benchmark writes its figures, a path that holds nothing yet.

    The file there may be a user's or figures they mean to keep; it is refused, not replaced.
    A missing folder is made when the figures are written (`write_new`).
    """
    path = Path(text)
    if path.exists() or path.is_symlink():
        raise argparse.ArgumentTypeError(
            f"{path} exists; pass another path (the file is left as it is)"
        )
    return path


def write_new(path: Path, text: str) -> Path:
    """Write a benchmark's figures to ``path`` (checked by `new_file`) and return where they went.

    A file that appeared there while the benchmark ran is left as it is: the figures go to the
    first free ``<stem>-N<suffix>`` beside it, and stderr says so, so minutes of measuring are
    neither lost nor written over anything.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    target, n = path, 0
    while True:
        try:
            with target.open("x") as f:
                f.write(text)
        except FileExistsError:
            n += 1
            target = path.with_name(f"{path.stem}-{n}{path.suffix}")
            continue
        if target != path:
            print(
                f"{path} appeared while the benchmark ran; figures written to {target}",
                file=sys.stderr,
            )
        return target


MIB = 1 << 20
_N = TypeVar("_N", int, float)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``low``."""

    def parse(text: str) -> int:
        return _checked(int, text, f"a whole number >= {low}", lambda v: v >= low)

    return parse


positive_int = int_at_least(1)


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0 (seconds, MiB)."""
    return _checked(float, text, "a number > 0", lambda v: 0 < v < math.inf)


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    return _checked(float, text, "a number >= 0", lambda v: 0 <= v < math.inf)


def fraction(text: str) -> float:
    """An argparse type: a number in [0, 1)."""
    return _checked(float, text, "a number in [0, 1)", lambda v: 0 <= v < 1)


def size_mib(text: str) -> float:
    """An argparse type: a size in MiB of at least one byte."""
    return _checked(
        float, text, "a size in MiB of at least one byte", lambda v: 1 <= v * MIB < math.inf
    )


def size_list_mib(text: str) -> list[float]:
    """An argparse type: comma-separated sizes in MiB (``1,16,256``), at least one."""
    sizes = [size_mib(item.strip()) for item in text.split(",") if item.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"want sizes in MiB such as 1,16,256, got {text!r}")
    return sizes


def _checked(kind: Callable[[str], _N], text: str, want: str, ok: Callable[[_N], bool]) -> _N:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want {want}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"want {want}, got {text!r}")
    return value
