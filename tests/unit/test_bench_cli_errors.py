"""`python -m arl.bench NAME` on bad input: a bad number is refused by argparse before anything
starts, a user error from a benchmark is one ``error:`` line (exit 2), Ctrl-C one line (exit
130), and an internal bug keeps its traceback. Only benchmarks that import no torch run here."""

from __future__ import annotations

import argparse
import sys
import types

import pytest

from arl.bench import (
    int_at_least,
    new_file,
    positive_float,
    positive_int,
    size_list_mib,
    size_mib,
    write_new,
)
from arl.bench.__main__ import BENCHMARKS
from arl.bench.__main__ import main as bench
from arl.config import ConfigError
from arl.data.gsm8k import DatasetError
from arl.engines.model import ModelResolutionError


@pytest.mark.parametrize(
    ("parse", "good", "bad"),
    [
        (positive_int, ("1", 1), ["0", "-5", "x", "1.5"]),
        (int_at_least(2), ("2", 2), ["1"]),
        (positive_float, ("0.5", 0.5), ["0", "-1", "nan", "inf", "x"]),
        (size_mib, ("0.5", 0.5), ["0", "-1", "1e-9", "x"]),
        (size_list_mib, ("1, 16,", [1.0, 16.0]), ["x", "0", "1,-1", ","]),
    ],
)
def test_the_argument_types_take_good_numbers_and_name_the_bad_ones(parse, good, bad):
    assert parse(good[0]) == good[1]
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=r"want .*got '"):
            parse(text)


@pytest.mark.parametrize(
    "argv",
    [
        ["sim", "--gen-time", "-1"],
        ["sim", "--steps", "0"],
        ["controller", "--batches", "0"],
        ["startup", "--timeout", "-1"],
    ],
)
def test_a_bad_number_is_a_usage_error_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit) as info:
        bench(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m arl.bench ") and "Traceback" not in err
    assert [line for line in err.splitlines() if "error:" in line] == [
        f"python -m arl.bench {argv[0]}: error: argument {argv[1]}: want "
        f"{'a number > 0' if argv[2] == '-1' else 'a whole number >= 1'}, got {argv[2]!r}"
    ]


def _fake_benchmark(monkeypatch, raised: BaseException) -> None:
    def main(argv):
        raise raised

    monkeypatch.setitem(BENCHMARKS, "fake", ("arl_fake_bench", "raises what the test asks"))
    monkeypatch.setitem(sys.modules, "arl_fake_bench", types.SimpleNamespace(main=main))


@pytest.mark.parametrize(
    "raised",
    [
        ConfigError("runs/x already holds files; pass --run-dir"),
        ModelResolutionError("model '/nonexistent' is neither a directory nor a hub id"),
        DatasetError("--data='/nonexistent': needs a directory holding test.jsonl"),
    ],
)
def test_a_user_error_from_a_benchmark_is_one_error_line(monkeypatch, capsys, raised):
    _fake_benchmark(monkeypatch, raised)
    assert bench(["fake"]) == 2
    assert capsys.readouterr().err == f"error: {raised}\n"


def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys):
    _fake_benchmark(monkeypatch, KeyboardInterrupt())
    assert bench(["fake"]) == 130
    assert capsys.readouterr().err == "interrupted: benchmark 'fake' stopped before its report\n"


def test_an_internal_bug_keeps_its_traceback(monkeypatch):
    _fake_benchmark(monkeypatch, ValueError("max() arg is an empty sequence"))
    with pytest.raises(ValueError, match="empty sequence"):
        bench(["fake"])


def test_the_sim_report_of_a_synchronous_run_alone_judges_no_target():
    from arl.bench.sim import Probe, SimResult, SimSpec, report

    probes = [Probe(t, 0.0, 0, 0) for t in (0.0, 1.0, 2.0)]
    rows = [{"step": s, "rollout/staleness": [0]} for s in (1, 2)]
    text = report([SimResult(SimSpec(eta=0), None, rows, probes, 0, [])])
    assert "| 0 | 3,600 |" in text and "target:" not in text


def test_a_result_file_that_exists_is_refused_before_anything_starts(tmp_path, capsys):
    """`--out`/`--json` name a new file: one already there is the user's and is left as it is."""
    mine = tmp_path / "mine.json"
    mine.write_text("kept")
    for argv in (["startup", "--out", str(mine)], ["sync", "--json", str(mine)]):
        with pytest.raises(SystemExit) as info:
            bench(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert f"error: argument {argv[1]}: {mine} exists; pass another path" in err, err
        assert "Traceback" not in err
    assert mine.read_text() == "kept"


def test_figures_go_beside_a_file_that_appeared_while_the_benchmark_ran(tmp_path, capsys):
    out = new_file(str(tmp_path / "figures" / "loop.json"))  # a missing folder is made
    assert write_new(out, "one") == out and out.read_text() == "one"
    assert write_new(out, "two") == tmp_path / "figures" / "loop-1.json"
    assert write_new(out, "three") == tmp_path / "figures" / "loop-2.json"
    assert out.read_text() == "one"
    assert "appeared while the benchmark ran; figures written to" in capsys.readouterr().err
    with pytest.raises(argparse.ArgumentTypeError, match="exists; pass another path"):
        new_file(str(out))


def test_an_output_folder_a_benchmark_did_not_make_is_refused(tmp_path):
    """e2e and sim write their traces and timeline into --out: only a benchmark's own folder
    (its marker inside) is replaced, and the error names --out."""
    from arl.bench import BENCH_MARK, fresh_run_dir

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "timeline.png").write_text("a user's")
    with pytest.raises(ConfigError, match=r"\(--out\)"):
        fresh_run_dir(theirs, "--out")
    assert (theirs / "timeline.png").read_text() == "a user's"
    ours = tmp_path / "ours"
    fresh_run_dir(ours, "--out")
    (ours / "trace_eta0.json").write_text("an earlier benchmark's")
    fresh_run_dir(ours, "--out")
    assert [p.name for p in ours.iterdir()] == [BENCH_MARK]
