"""Reward transform and normalisation against hand-computed values."""

import pytest
import torch

from arl.algo.rewards import normalize_rewards, transform_rewards


def test_transform_bias_scale_clip():
    r = torch.tensor([0.0, 1.0, 3.0])
    # (0 - .5) * 10 = -5, (1 - .5) * 10 = 5, (3 - .5) * 10 = 25 -> clipped to 20
    out = transform_rewards(r, bias=-0.5, scaling=10.0, clip=20.0)
    assert out.tolist() == [-5.0, 5.0, 20.0]
    assert transform_rewards(r, bias=-0.5, scaling=10.0, clip=None).tolist() == [-5.0, 5.0, 25.0]


def test_transform_rejects_non_positive_clip():
    with pytest.raises(ValueError, match="clip must be positive"):
        transform_rewards(torch.zeros(2), clip=0.0)


R = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0])
G = torch.tensor([0, 0, 0, 0, 7, 7])


def test_group_normalisation_biased_and_unbiased():
    # group 0: mean .5, biased std .5; group 7: mean 3, biased std 1
    out = normalize_rewards(R, G, eps=0.0)
    assert torch.allclose(out, torch.tensor([1.0, -1.0, -1.0, 1.0, -1.0, 1.0]))
    # unbiased: std sqrt(1/3) = 0.57735 and sqrt(2) = 1.41421
    out = normalize_rewards(R, G, eps=0.0, unbiased=True)
    expect = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025, -0.707107, 0.707107])
    assert torch.allclose(out, expect, atol=1e-6)


def test_batch_normalisation():
    # mean 8/6, biased var 102/54 -> std 1.374369
    out = normalize_rewards(R, G, mean_level="batch", std_level="batch", eps=0.0)
    expect = torch.tensor([-0.242536, -0.970143, -0.970143, -0.242536, 0.485071, 1.940285])
    assert torch.allclose(out, expect, atol=1e-6)


def test_group_mean_batch_std():
    out = normalize_rewards(R, G, mean_level="group", std_level="batch", eps=0.0)
    # group 0: +-.5 / 1.374369; group 7: +-1 / 1.374369
    expect = torch.tensor([0.363803, -0.363803, -0.363803, 0.363803, -0.727607, 0.727607])
    assert torch.allclose(out, expect, atol=1e-6)


def test_none_levels_and_std_only():
    assert torch.equal(normalize_rewards(R, G, mean_level="none", std_level="none"), R)
    out = normalize_rewards(R[4:], G[4:], mean_level="none", std_level="group", eps=0.0)
    assert torch.allclose(out, torch.tensor([2.0, 4.0]))  # group std is 1


def test_constant_group_gives_zero_not_nan():
    out = normalize_rewards(torch.tensor([1.0, 1.0, 5.0]), torch.tensor([0, 0, 1]), unbiased=True)
    assert out.tolist() == [0.0, 0.0, 0.0]


def test_group_level_needs_group_ids():
    with pytest.raises(ValueError, match="group_ids"):
        normalize_rewards(R, None, mean_level="group")


def test_unknown_level_is_rejected():
    with pytest.raises(ValueError, match="mean_level"):
        normalize_rewards(R, G, mean_level="global")  # type: ignore[arg-type]
