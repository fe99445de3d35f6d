"""`probe_gap`: the statistics the server weight check compares (see `arl.weights.verify`)."""

from __future__ import annotations

import pytest

from arl.weights import WeightSyncError
from arl.weights.verify import probe_gap


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


def test_the_trainer_scores_with_weights_rounded_as_a_bf16_engine_holds_them() -> None:
    import torch

    from arl.node.train import _weights_rounded_to

    layer = torch.nn.Linear(2, 1, bias=False)
    trained = torch.tensor([[1.0 + 1e-5, 0.5]])  # an update below bf16's spacing
    with torch.no_grad():
        layer.weight.copy_(trained)
    with _weights_rounded_to(layer, torch.bfloat16):
        assert layer.weight.dtype == torch.float32
        assert layer.weight.tolist() == [[1.0, 0.5]]
    assert torch.equal(layer.weight, trained)
    with _weights_rounded_to(layer, None):
        assert layer.weight[0, 0].item() != 1.0
