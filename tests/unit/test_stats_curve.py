"""`python -m arl.stats.curve`: curve points from metrics.jsonl rows (the logger's keys)."""

import json

from arl.stats.curve import curve, main


def _rows():
    return [
        {
            "step": 1,
            "time": 110.0,
            "time/step_s": 10.0,
            "time/logp_s": 1.0,
            "time/update_s": 3.0,
            "batch/n_tokens": 8000,
            "rollout/gen_tokens": 5000,
            "rollout/accuracy": 0.1,
        },
        {
            "step": 2,
            "time": 115.0,
            "time/step_s": 5.0,
            "time/logp_s": 1.0,
            "time/update_s": 1.0,
            "batch/n_tokens": 8000,
            "rollout/gen_tokens": 4000,
            "eval/accuracy": 0.25,
        },
        {"eval_only": True},
    ]


def test_curve_points_measure_from_the_start_of_step_one():
    pts = curve(_rows())
    assert [p["step"] for p in pts] == [1, 2]
    assert pts[0]["wall_s"] == 10.0 and pts[1]["wall_s"] == 15.0
    assert pts[0]["gen_tokens_per_s"] == 500.0 and pts[1]["train_tokens_per_s"] == 4000.0
    assert "eval_accuracy" not in pts[0] and pts[1]["eval_accuracy"] == 0.25


def test_main_writes_json_and_never_overwrites(tmp_path, capsys):
    m = tmp_path / "metrics.jsonl"
    m.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    out = tmp_path / "curve.json"
    assert main([str(m), "--out", str(out)]) == 0
    assert json.loads(out.read_text())[1]["eval_accuracy"] == 0.25
    assert main([str(m), "--out", str(out)]) == 2
    assert "exists" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.jsonl")]) == 2
