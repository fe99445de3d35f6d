"""LR schedules against hand-computed values."""

import pytest

from arl.algo.schedule import lr_at


@pytest.mark.parametrize(
    ("schedule", "step", "expect"),
    [
        ("constant", 0, 0.5),  # warmup (0 + 1) / 2
        ("constant", 1, 1.0),
        ("constant", 100, 1.0),
        ("linear", 2, 1.0),  # p = 0
        ("linear", 4, 0.55),  # p = .5: 1 - .9 * .5
        ("linear", 6, 0.1),
        ("linear", 50, 0.1),  # past the end stays at min
        ("cosine", 3, 0.868198),  # p = .25: .1 + .45 * (1 + cos(pi / 4))
        ("cosine", 4, 0.55),
        ("cosine", 6, 0.1),
    ],
)
def test_lr_at(schedule, step, expect):
    lr = lr_at(
        step, base_lr=1.0, schedule=schedule, warmup_steps=2, total_steps=6, min_lr_ratio=0.1
    )
    assert lr == pytest.approx(expect, abs=1e-6)


def test_decay_needs_total_steps():
    with pytest.raises(ValueError, match="total_steps"):
        lr_at(3, base_lr=1.0, schedule="cosine", warmup_steps=2, total_steps=None)
