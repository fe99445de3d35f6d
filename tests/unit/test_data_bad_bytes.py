"""Undecodable bytes in a JSONL dataset are one malformed row, like any other (issue 19, item 8)."""

from __future__ import annotations

import json

import pytest

from arl.config import Config, apply_overrides
from arl.data.gsm8k import DatasetError, load_gsm8k
from arl.data.loader import load_rows


def _write(directory, lines: list[bytes]) -> None:
    directory.mkdir(exist_ok=True)
    (directory / "train.jsonl").write_bytes(b"\n".join(lines) + b"\n")


def _row(i: int) -> bytes:
    return json.dumps({"question": f"q{i}?", "answer": f"so #### {i}"}).encode()


BAD = b'{"question": "caf\xe9?", "answer": "#### 1"}'  # latin-1, not UTF-8


def test_a_non_utf8_line_is_skipped_and_counted(tmp_path):
    _write(tmp_path / "d", [_row(0), BAD, _row(2)])
    rows, stats = load_gsm8k(str(tmp_path / "d"), "train", on_bad_row="skip")
    assert [r["question"] for r in rows] == ["q0?", "q2?"]
    assert (stats.kept, stats.skipped) == (2, 1)
    assert stats.reasons == {"bad JSON": 1}


def test_a_non_utf8_line_under_error_names_file_line_and_byte(tmp_path):
    _write(tmp_path / "d", [_row(0), BAD])
    with pytest.raises(DatasetError) as info:
        load_gsm8k(str(tmp_path / "d"), "train", on_bad_row="error")
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / 'd' / 'train.jsonl'}:2: bad JSON (not UTF-8: byte 0xe9")
    assert "on_bad_row='skip'" in msg


def test_the_default_config_loads_past_a_bad_byte(tmp_path):
    _write(tmp_path / "d", [BAD, _row(1)])
    cfg = apply_overrides(Config(), [f"data.path={tmp_path / 'd'}"])
    assert [r["question"] for r in load_rows(cfg, "train")] == ["q1?"]
