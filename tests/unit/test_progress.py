"""What a run shows at its end: the summary's lines, and a slow end-of-run phase named."""

from __future__ import annotations

from arl.stats.progress import SLOW_S, say_if_slow, summary


def test_a_phase_over_the_threshold_is_printed_on_one_line_and_a_quick_one_is_not(capsys):
    say_if_slow("exporting the model to /r/checkpoints/step3", SLOW_S + 1.25)
    say_if_slow("shutting down", SLOW_S - 0.5)
    out = capsys.readouterr().out
    assert out == f"exporting the model to /r/checkpoints/step3 took {SLOW_S + 1.25:.1f} s\n"


def test_the_summary_names_the_attempt_the_last_step_and_the_files_that_exist(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("{}\n")
    (tmp_path / "checkpoints").mkdir()
    text = summary(
        125.4,
        7,
        tmp_path,
        resumed_from=4,
        last_metrics={"rollout/reward_mean": 0.5, "rollout/accuracy": 0.25},
        last_eval=(6, {"eval/accuracy": 0.75, "eval/n": 40}),
        metrics_path=metrics,
        trace_path=tmp_path / "trace.json",  # not written: not shown
    )
    first, *files, plot = text.splitlines()
    assert first == (
        "done: 7 steps (3 in this attempt, resumed from step 4) in 2 min 05 s; last step: "
        "reward 0.500, accuracy 0.25; held-out accuracy 0.75 (40 questions, step 6)"
    )
    assert [f.split()[0] for f in files] == ["metrics", "checkpoints"]
    assert plot.startswith(f"plot: python -m arl.stats.plot {metrics} -o ")
