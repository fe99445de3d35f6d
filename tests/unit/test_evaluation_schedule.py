"""When the trainer evaluates: every ``evaluator.freq_steps`` steps and after the last step."""

from pathlib import Path

import pytest

from arl.config import EvaluatorConfig
from arl.recipe import apply_cpu_preset, import_recipe, load_recipe


def _eval_steps(freq: int | None, total: int) -> list[int]:
    ev = EvaluatorConfig(freq_steps=freq)
    return [step for step in range(1, total + 1) if ev.due(step, total)]


@pytest.mark.parametrize(
    ("freq", "total", "steps"),
    [
        (6, 6, [6]),
        (6, 2, [2]),  # a run shorter than freq_steps still ends with an evaluation
        (6, 7, [6, 7]),
        (10, 20, [10, 20]),
        (1, 3, [1, 2, 3]),
        (None, 5, []),  # none: never
    ],
)
def test_evaluation_runs_every_freq_steps_and_after_the_last_step(freq, total, steps):
    assert _eval_steps(freq, total) == steps


def test_arith_evaluates_after_the_last_step_and_as_often_as_its_presets_say():
    path = str(Path(__file__).resolve().parents[2] / "recipes" / "arith.py")
    recipe = import_recipe(path)
    gpu = load_recipe(path, recipe)
    assert _eval_steps(gpu.evaluator.freq_steps, gpu.experiment.total_train_steps) == [10, 20]
    cpu = load_recipe(path, recipe)
    apply_cpu_preset(path, recipe, cpu)
    total = cpu.experiment.total_train_steps
    assert (total, _eval_steps(cpu.evaluator.freq_steps, total)) == (6, [6])  # the quick start
    assert _eval_steps(cpu.evaluator.freq_steps, 2) == [2]  # experiment.total_train_steps=2
