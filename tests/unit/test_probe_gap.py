"""`probe_gap`: the statistics the server weight check compares (see `verify_weights`)."""

from __future__ import annotations

import pytest

from arl.trainer import probe_gap
from arl.weights import WeightSyncError


def test_shift_is_the_mean_difference_and_spread_the_mean_absolute_one() -> None:
    shift, spread = probe_gap([-1.0, -2.5, -0.5], [-1.5, -2.0, -0.5])
    assert shift == pytest.approx(0.0)  # +0.5 and -0.5 cancel: random-signed numerics
    assert spread == pytest.approx(1.0 / 3)


def test_a_coherent_move_shows_in_both() -> None:
    shift, spread = probe_gap([-1.2, -2.2, -0.7], [-1.0, -2.0, -0.5])
    assert shift == pytest.approx(-0.2) and spread == pytest.approx(0.2)


def test_sequences_of_different_lengths_are_refused() -> None:
    with pytest.raises(WeightSyncError, match="same sequence"):
        probe_gap([-1.0], [-1.0, -2.0])
