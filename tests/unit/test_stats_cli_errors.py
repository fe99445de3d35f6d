"""The stats command lines (`arl.stats.plot`, `curve`, `trace_png`) on bad input: one ``error:``
line and exit 2, no traceback, and a file the user already has is never replaced."""

from __future__ import annotations

import json

import pytest

from arl.stats import curve, plot, trace_png

ROWS = [
    {"step": 1, "time": 10.0, "time/step_s": 1.0, "rollout/accuracy": 0.25},
    {"step": 2, "time": 11.0, "time/step_s": 1.0, "rollout/accuracy": 0.5},
]


def _metrics(tmp_path, tail: str = ""):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + tail)
    return path


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(("cli", "default"), [(plot, "curve.png"), (trace_png, "timeline.png")])
def test_an_existing_output_file_is_refused_and_kept(tmp_path, monkeypatch, capsys, cli, default):
    pytest.importorskip("matplotlib")
    metrics = _metrics(tmp_path)
    mine = tmp_path / "mine.png"
    mine.write_text("precious")
    assert cli.main([str(metrics), "-o", str(mine)]) == 2
    assert "mine.png exists; pass another -o" in _one_error_line(capsys)
    monkeypatch.chdir(tmp_path)  # the default -o, in the current directory
    (tmp_path / default).write_text("precious")
    assert cli.main([str(metrics)]) == 2
    assert f"{default} exists" in _one_error_line(capsys)
    assert mine.read_text() == (tmp_path / default).read_text() == "precious"


def test_output_paths_that_cannot_be_written_are_refused_before_reading(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    metrics = _metrics(tmp_path)
    assert plot.main([str(metrics), "-o", str(tmp_path / "no" / "x.png")]) == 2
    assert "is not a directory; create it or pass another -o" in _one_error_line(capsys)
    assert plot.main([str(metrics), "-o", str(tmp_path / "x.txt")]) == 2
    assert ".png" in _one_error_line(capsys)
    assert curve.main([str(metrics), "--out", str(tmp_path / "no" / "x.json")]) == 2
    assert "pass another --out" in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


@pytest.mark.parametrize(
    ("content", "says"),
    [
        ("# arl\n\nA README.\n", "line 1: not JSON"),
        ('{"step": 1}\n{"step": 2,\n{"step": 3}\n', "line 2: not JSON"),
        ("[1, 2]\n", "line 1: a JSON list, not an object"),
        (b"\x89PNG\r\n\x1a\n\xff\xfe", "not a text file"),
    ],
)
def test_a_file_that_is_not_metrics_is_one_error_line(tmp_path, capsys, content, says):
    pytest.importorskip("matplotlib")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert plot.main([str(bad), "-o", str(tmp_path / "x.png")]) == 2
    assert says in _one_error_line(capsys)
    assert curve.main([str(bad)]) == 2
    assert says in _one_error_line(capsys)
    assert trace_png.main([str(bad), "-o", str(tmp_path / "t.png")]) == 2
    assert str(bad) in _one_error_line(capsys)  # not a trace either
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "t.png").exists()


def test_a_partly_written_last_line_of_a_live_run_is_skipped(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    metrics = _metrics(tmp_path, tail='{"step": 3, "time": 12.0, "rollout/acc')
    out = tmp_path / "curve.png"
    assert plot.main([str(metrics), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert curve.main([str(metrics)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table[1:]] == ["1", "2"]


def test_keys_that_name_no_metric_are_refused_with_the_keys_there(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    metrics = _metrics(tmp_path)
    assert plot.main([str(metrics), "--keys", "eval/acc", "-o", str(tmp_path / "x.png")]) == 2
    assert "pass --keys from: rollout/accuracy" in _one_error_line(capsys)
