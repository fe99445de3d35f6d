"""PPO loss, decoupled weights, rejection, KL estimators, token log-probs: hand-computed cases."""

import math

import pytest
import torch

from arl.algo.losses import kl_estimate, ppo_loss, reject_by_ratio, token_logp_entropy

T, F = True, False
# four tokens with ratios 1.5, .5, 1.5, .5 and advantages 1, 1, -1, -1
OLD = torch.zeros(1, 4)
LOGP = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.5), math.log(0.5)]])
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
MASK = torch.ones(1, 4, dtype=torch.bool)


def test_clipped_surrogate():
    # l = max(-A r, -A clip(r, .8, 1.2)): -1.2 (clipped), -.5, 1.5, .8 (clipped); sum .6
    loss, st = ppo_loss(LOGP, OLD, ADV, MASK, eps_clip=0.2)
    assert loss.item() == pytest.approx(0.15)
    assert st["clip_frac"].item() == pytest.approx(0.5)
    assert st["n_tokens"].item() == 4
    # approx KL = mean(old - logp) = -(2 ln 1.5 + 2 ln .5) / 4
    assert st["approx_kl"].item() == pytest.approx(0.143841, abs=1e-6)


def test_global_token_count_divides_the_sum():
    loss, _ = ppo_loss(LOGP, OLD, ADV, MASK, eps_clip=0.2, n_tokens=10)
    assert loss.item() == pytest.approx(0.06)


def test_gradient_flows_only_through_unclipped_tokens():
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = ppo_loss(logp, OLD, ADV, MASK, eps_clip=0.2)
    loss.backward()
    # d(-A r)/dlogp = -A r: token 2 -> -.5, token 3 -> 1.5; clipped tokens 0; over 4 tokens
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.125, 0.375, 0.0]]))


def test_eps_clip_higher():
    # upper bound 1.6: token 1 is no longer clipped (-1.5); sum .3
    loss, st = ppo_loss(LOGP, OLD, ADV, MASK, eps_clip=0.2, eps_clip_higher=0.6)
    assert loss.item() == pytest.approx(0.075)
    assert st["clip_frac"].item() == pytest.approx(0.25)


def test_dual_clip_bounds_negative_advantage_loss():
    logp = torch.tensor([[math.log(5.0), math.log(2.0)]])
    adv = torch.tensor([[-1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    # r = 5: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual); r = 2: 2 < 3 stays
    loss, st = ppo_loss(logp, torch.zeros(1, 2), adv, mask, eps_clip=0.2, c_clip=3.0, n_tokens=1)
    assert loss.item() == pytest.approx(5.0)
    assert st["dual_clip_frac"].item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="c_clip must be > 1"):
        ppo_loss(logp, torch.zeros(1, 2), adv, mask, eps_clip=0.2, c_clip=1.0)


def test_masked_tokens_do_not_count():
    mask = torch.tensor([[T, T, F, F]])
    loss, st = ppo_loss(LOGP, OLD, ADV, mask, eps_clip=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5) / 2)
    assert st["n_tokens"].item() == 2


# decoupled: logp = prox (ratio 1, no clipping), A = 1, so each token's loss is -w
W = torch.tensor([[2.0, 8.0, 0.1, 1.0]])
PROX = torch.zeros(1, 4)
BEHAVE = -torch.log(W)  # w = exp(prox - behave)
ONES = torch.ones(1, 4)


@pytest.mark.parametrize(
    ("rejection", "expect", "rejected"),
    [
        ("none", -(2 + 5 + 0.1 + 1) / 4, 0.0),  # truncated: 8 -> 5
        ("token_mask", -(2 + 1) / 4, 0.5),  # 8 and .1 lie outside [1/5, 5]
        ("token_clamp", -(2 + 5 + 0.2 + 1) / 4, 0.0),
    ],
)
def test_decoupled_weight_and_rejection(rejection, expect, rejected):
    loss, st = ppo_loss(
        PROX,
        PROX,
        ONES,
        MASK,
        eps_clip=0.2,
        behave_logp=BEHAVE,
        imp_weight_cap=5.0,
        rejection=rejection,
        n_tokens=4,
    )
    assert loss.item() == pytest.approx(expect, rel=1e-5)
    assert st["rejected_frac"].item() == pytest.approx(rejected)


def test_decoupled_without_cap_uses_the_raw_weight():
    loss, st = ppo_loss(PROX, PROX, ONES, MASK, eps_clip=0.2, behave_logp=BEHAVE)
    assert loss.item() == pytest.approx(-(2 + 8 + 0.1 + 1) / 4, rel=1e-5)
    assert st["imp_weight_max"].item() == pytest.approx(8.0)
    assert st["imp_weight_min"].item() == pytest.approx(0.1)


def test_seq_mask_drops_whole_rows():
    w = torch.tensor([[2.0, 8.0], [1.5, 1.0]])
    loss, st = ppo_loss(
        torch.zeros(2, 2),
        torch.zeros(2, 2),
        torch.ones(2, 2),
        torch.ones(2, 2, dtype=torch.bool),
        eps_clip=0.2,
        behave_logp=-torch.log(w),
        imp_weight_cap=5.0,
        rejection="seq_mask",
        n_tokens=4,
    )
    assert loss.item() == pytest.approx(-(1.5 + 1.0) / 4)
    assert st["rejected_frac"].item() == pytest.approx(0.5)


def test_seq_mask_of_a_packed_row_drops_whole_sequences_by_their_ids():
    # The rows of test_seq_mask_drops_whole_rows packed into one row, a pad sequence after them:
    # the same loss, and the pad (id 2, masked out) rejects nothing.
    w = torch.tensor([[2.0, 8.0, 1.5, 1.0, 50.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    loss, st = ppo_loss(
        torch.zeros(1, 5),
        torch.zeros(1, 5),
        torch.ones(1, 5),
        mask,
        eps_clip=0.2,
        behave_logp=-torch.log(w),
        imp_weight_cap=5.0,
        rejection="seq_mask",
        n_tokens=4,
        seq_ids=torch.tensor([[0, 0, 1, 1, 2]]),
        n_seqs=4,
    )
    assert loss.item() == pytest.approx(-(1.5 + 1.0) / 4)
    assert st["rejected_frac"].item() == pytest.approx(0.5)


def test_rejection_needs_decoupled_loss_and_cap():
    with pytest.raises(ValueError, match="decoupled"):
        ppo_loss(LOGP, OLD, ADV, MASK, eps_clip=0.2, rejection="token_mask")
    with pytest.raises(ValueError, match="cap"):
        ppo_loss(PROX, PROX, ONES, MASK, eps_clip=0.2, behave_logp=BEHAVE, rejection="seq_mask")


def test_reject_by_ratio_modes():
    ratio = torch.tensor([[0.1, 1.0, 3.0], [1.0, 1.1, 0.0]])
    mask = torch.tensor([[T, T, T], [T, T, F]])  # the out-of-bound 0.0 is padding
    r, m = reject_by_ratio(ratio, mask, low=0.5, high=2.0, mode="token_mask")
    assert m.tolist() == [[F, T, F], [T, T, F]]
    r, m = reject_by_ratio(ratio, mask, low=0.5, high=2.0, mode="seq_mask")
    assert m.tolist() == [[F, F, F], [T, T, F]]
    r, m = reject_by_ratio(ratio, mask, low=0.5, high=2.0, mode="token_clamp")
    assert r.tolist() == [[0.5, 1.0, 2.0], [1.0, 1.100000023841858, 0.5]]
    assert m.tolist() == mask.tolist()
    with pytest.raises(ValueError, match="rejection must be one of"):
        reject_by_ratio(ratio, mask, low=0.5, high=2.0, mode="drop")  # type: ignore[arg-type]


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-2.0, -1.0])  # log r = -1, +1
    assert torch.allclose(kl_estimate(logp, ref, "k1"), torch.tensor([1.0, -1.0]))
    assert torch.allclose(kl_estimate(logp, ref, "k2"), torch.tensor([0.5, 0.5]))
    # k3 = e^{log r} - 1 - log r: e^-1 = .367879, e - 2 = .718282
    assert torch.allclose(kl_estimate(logp, ref, "k3"), torch.tensor([0.367879, 0.718282]))
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_token_logp_entropy_with_temperature_and_packed_starts():
    # vocab 2; z = logits / 2: row position 0 -> [0, ln 3] (p = 1/4, 3/4), position 1 -> [0, 0]
    logits = torch.tensor([[[0.0, 2 * math.log(3.0)], [0.0, 0.0], [5.0, 5.0]]])
    ids = torch.tensor([[0, 1, 0]])
    logp, ent = token_logp_entropy(logits, ids, torch.tensor([[0, 1, 2]]), temperature=2.0)
    assert torch.allclose(logp, torch.tensor([[0.0, math.log(0.75), math.log(0.5)]]))
    # H(1/4, 3/4) = .562335, H(1/2, 1/2) = ln 2
    assert torch.allclose(ent, torch.tensor([[0.0, 0.562335, math.log(2.0)]]), atol=1e-6)
    # a second packed sequence starting at position 2 gets 0 there
    logp, ent = token_logp_entropy(logits, ids, torch.tensor([[0, 1, 0]]), temperature=2.0)
    assert logp[0, 2].item() == 0.0 and ent[0, 2].item() == 0.0
