"""GRPO and GAE advantages, token rewards, advantage normalisation: hand-computed cases."""

import torch

from arl.algo.advantages import (
    gae_advantages,
    grpo_advantages,
    last_token_index,
    normalize_advantages,
    token_rewards,
)

T, F = True, False


def test_grpo_puts_the_sequence_reward_on_completion_tokens():
    mask = torch.tensor([[F, T, T], [F, F, T]])
    adv = grpo_advantages(torch.tensor([0.5, -1.0]), mask)
    assert adv.tolist() == [[0.0, 0.5, 0.5], [0.0, 0.0, -1.0]]


def test_last_token_index():
    mask = torch.tensor([[F, T, T, F], [F, F, F, F], [T, F, F, F]])
    assert last_token_index(mask).tolist() == [2, -1, 0]


def test_token_rewards_with_kl():
    mask = torch.tensor([[F, T, T, F], [T, T, F, F]])
    kl = torch.tensor([[9.0, 0.1, 0.2, 9.0], [0.3, 0.4, 9.0, 9.0]])
    r = token_rewards(torch.tensor([1.0, 2.0]), mask, kl, kl_ctl=0.5)
    expect = torch.tensor([[0.0, -0.05, 0.9, 0.0], [-0.15, 1.8, 0.0, 0.0]])
    assert torch.allclose(r, expect)


def test_gae_hand_computed():
    # gamma .9, lambda .8 over completion tokens 1..3:
    # t=3: d = 1 - .7 = .3, A = .3
    # t=2: d = .9*.7 - .6 = .03, A = .03 + .72*.3 = .246
    # t=1: d = .9*.6 - .5 = .04, A = .04 + .72*.246 = .21712
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    v = torch.tensor([[9.0, 0.5, 0.6, 0.7]])
    mask = torch.tensor([[F, T, T, T]])
    adv, ret = gae_advantages(r, v, mask, gamma=0.9, lam=0.8)
    assert torch.allclose(adv, torch.tensor([[0.0, 0.21712, 0.246, 0.3]]))
    assert torch.allclose(ret, torch.tensor([[0.0, 0.71712, 0.846, 1.0]]))


def test_gae_skips_unmasked_tokens_inside_a_row():
    # the middle token (e.g. tool output) is skipped: t=0 bootstraps from t=2
    # t=2: A = 1 - .7 = .3; t=0: d = .9*.7 - .5 = .13, A = .13 + .72*.3 = .346
    r = torch.tensor([[0.0, 5.0, 1.0]])
    v = torch.tensor([[0.5, 9.0, 0.7]])
    adv, _ = gae_advantages(r, v, torch.tensor([[T, F, T]]), gamma=0.9, lam=0.8)
    assert torch.allclose(adv, torch.tensor([[0.346, 0.0, 0.3]]))


def test_gae_with_gamma_lambda_one_and_zero_values_is_reward_to_go():
    r = torch.tensor([[0.0, 0.5, 0.25, 2.0]])
    adv, _ = gae_advantages(
        r, torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool), gamma=1.0, lam=1.0
    )
    assert adv.tolist() == [[2.75, 2.75, 2.25, 2.0]]


def test_advantage_normalisation_over_masked_tokens():
    adv = torch.tensor([[1.0, 1.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[T, T, F], [T, F, F]])
    # values 1, 1, 3: mean 5/3, biased std sqrt(8/9) = .942809
    out = normalize_advantages(adv, mask, eps=0.0)
    expect = torch.tensor([[-0.707107, -0.707107, 0.0], [1.414214, 0.0, 0.0]])
    assert torch.allclose(out, expect, atol=1e-6)


def test_advantage_normalisation_per_group():
    adv = torch.tensor([[1.0, 3.0], [5.0, 5.0], [0.0, 2.0]])
    mask = torch.ones(3, 2, dtype=torch.bool)
    # group 0 = rows 0, 2: values 1, 3, 0, 2 -> mean 1.5, biased std sqrt(1.25) = 1.118034
    out = normalize_advantages(
        adv,
        mask,
        mean_level="group",
        std_level="group",
        group_ids=torch.tensor([0, 1, 0]),
        eps=0.0,
    )
    expect = torch.tensor([[-0.447214, 1.341641], [0.0, 0.0], [-1.341641, 0.447214]])
    assert torch.allclose(out, expect, atol=1e-6)
