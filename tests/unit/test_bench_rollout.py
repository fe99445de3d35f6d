"""``python -m arl.bench rollout`` on a tiny random model, hf engine only (no vLLM server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from arl.bench import rollout
from tests.support.tiny_model import make_tiny_model


def _table_rows(text: str) -> list[list[str]]:
    """The cells of each data row of the printed markdown table (header and rule dropped)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    return [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]


def test_hf_only_quick_run_prints_one_row_per_scenario_and_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    argv = ["--model", model, "--skip-vllm", "--quick", "--scenarios", "2x8,4x12"]

    assert rollout.main(argv) == 0

    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("2 × 2", "hf", "float32"),
        ("2 × 2", "hf", "bfloat16"),
        ("4 × 3", "hf", "float32"),
        ("4 × 3", "hf", "bfloat16"),
    ]
    for row in rows:
        assert len(row) == 9
        tokens, seconds, tok_s = int(row[3]), float(row[4]), float(row[5])
        budget = int(row[0].split("×")[0]) * int(row[0].split("×")[1])
        assert 0 < tokens <= budget
        assert seconds > 0 and tok_s > 0
        assert row[6] == "—" and row[7] == "—"  # no vLLM peer: no ratio, no verdict
    assert "reproduce: `python -m arl.bench rollout --model" in out


def test_scenarios_parse_and_reject_malformed() -> None:
    assert rollout.parse_scenarios("8x64, 32×128") == [
        rollout.Scenario(8, 64),
        rollout.Scenario(32, 128),
    ]
    with pytest.raises(ValueError, match="8x64"):
        rollout.parse_scenarios("8-64")


def test_report_ratio_and_target_against_the_vllm_row() -> None:
    s = rollout.Scenario(8, 64)
    ms = [
        rollout.Measurement(s, "hf", "float32", 500, 10.0, 0),  # 50 tok/s
        rollout.Measurement(s, "hf", "bfloat16", 450, 5.0, 1),  # 90 tok/s
        rollout.Measurement(s, "vllm", "bfloat16", 512, 5.12, 0),  # 100 tok/s
    ]
    rows = _table_rows(rollout.report(ms, "ctx", "cmd"))
    assert [(r[1], r[2], r[6], r[7]) for r in rows] == [
        ("hf", "float32", "0.50", "MISSED"),
        ("hf", "bfloat16", "0.90", "met"),
        ("vllm", "bfloat16", "1.00", "—"),
    ]
    assert rows[1][8] == "1/8"


def test_median_round_is_reported() -> None:
    s = rollout.Scenario(2, 4)
    ms = [rollout.Measurement(s, "hf", "float32", 8, t, 0) for t in (1.0, 4.0, 2.0)]
    ((median, n),) = rollout.median_rounds(ms)
    assert n == 3 and median.seconds == 2.0
