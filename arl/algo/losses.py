"""PPO policy loss (clipped, dual-clip, decoupled), rejection by ratio bounds, KL estimators.

Conventions: every per-token tensor is [B, L]; position t holds the log-prob of token t given
the tokens before it (0 at position 0); ``loss_mask`` is True on completion tokens.
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3"]
Rejection = Literal["none", "token_mask", "seq_mask", "token_clamp"]
REJECTIONS: tuple[str, ...] = ("none", "token_mask", "seq_mask", "token_clamp")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum(x * m) / max(sum(m), 1): the mean over masked entries, 0 when none are masked."""
    m = mask.bool()
    return torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1)


def token_logp_entropy(
    logits: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position log-prob of the token and entropy of the distribution that predicted it.

    With z = logits / temperature (as the inference engine samples): logp[t] =
    log_softmax(z[t-1])[id_t], H[t] = -sum_v p_v log p_v of softmax(z[t-1]); both are 0 wherever
    position_ids == 0 (the first token of a row or of a packed sequence). Shapes [N, T(, V)].
    The entropy carries no gradient.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive for log-probs, got {temperature}")
    z = logits[:, :-1].float() / temperature
    logz = torch.log_softmax(z, dim=-1)
    logp = logz.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    with torch.no_grad():  # a statistic only: no [T, V] buffers kept for backward
        entropy = -(logz.exp() * logz).sum(-1)
    zero = torch.zeros_like(logp[:, :1])
    starts = position_ids == 0
    logp = torch.where(starts, 0.0, torch.cat([zero, logp], dim=1))
    entropy = torch.where(starts, 0.0, torch.cat([zero, entropy], dim=1))
    return logp, entropy


def kl_estimate(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k1"
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled by pi; log r = ref_logp - logp.

    k1 = -log r,  k2 = (log r)^2 / 2,  k3 = (r - 1) - log r   (Schulman, "Approximating KL").
    """
    log_r = ref_logp.float() - logp.float()
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r * log_r
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kl estimator must be one of k1, k2, k3, got {estimator!r}")


def reject_by_ratio(
    ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
    mode: Rejection,
    seq_ids: torch.Tensor | None = None,
    n_seqs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply ratio bounds [low, high] to per-token ratios [B, L]; returns (ratio, mask).

    token_mask: drop tokens with ratio outside the bounds; seq_mask: drop every token of a
    sequence that has any masked token outside them (a sequence is a row, or with ``seq_ids``,
    the tokens of the same id in 0..n_seqs-1: the sequences of a packed row); token_clamp:
    ratio <- clamp(ratio, low, high), mask kept; none: both unchanged.
    """
    m = mask.bool()
    inside = (ratio >= low) & (ratio <= high)
    if mode == "none":
        return ratio, m
    if mode == "token_mask":
        return ratio, m & inside
    if mode == "seq_mask":
        if seq_ids is None:
            row_ok = (inside | ~m).all(dim=-1, keepdim=True)
            return ratio, m & row_ok
        outside = (m & ~inside).reshape(-1).to(torch.int32)
        bad = torch.zeros(n_seqs, dtype=torch.int32, device=m.device)
        bad.index_add_(0, seq_ids.reshape(-1), outside)
        return ratio, m & (bad[seq_ids] == 0)
    if mode == "token_clamp":
        return ratio.clamp(low, high), m
    raise ValueError(f"rejection must be one of {REJECTIONS}, got {mode!r}")


def ppo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behave_logp: torch.Tensor | None = None,
    imp_weight_cap: float | None = None,
    rejection: Rejection = "none",
    n_tokens: float | torch.Tensor | None = None,
    seq_ids: torch.Tensor | None = None,
    n_seqs: int = 0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level PPO loss: sum_t m_t * w_t * l_t / N.

    r = exp(logp - old_logp), l = max(-A r, -A clip(r, 1 - eps, 1 + eps_high)); with dual clip
    c > 1, l = min(l, -c A) where A < 0. Decoupled (behave_logp given): old_logp is the proximal
    policy and w = exp(old_logp - behave_logp): "none" truncates it, w <- min(w, cap); the
    rejection modes bound it to [1/cap, cap] (mask tokens, mask sequences, or clamp); else w = 1.
    N is the global token count (all micro-batches, all ranks) so that summed gradients equal
    the full-batch loss; None means this call's count. ``seq_ids``/``n_seqs`` tell the sequences
    of packed rows apart for seq_mask (`reject_by_ratio`).
    Stats are masked means (``*_max``/``*_min`` are extremes) as detached tensors.
    """
    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
    if c_clip is not None and c_clip <= 1.0:
        raise ValueError(f"dual clip c_clip must be > 1 (or None to disable), got {c_clip}")
    mask = loss_mask.bool()
    adv = advantages.float().detach()
    log_ratio = logp.float() - old_logp.float().detach()
    ratio = torch.exp(torch.where(mask, log_ratio, 0.0))
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    tok_loss = torch.maximum(loss1, loss2)
    clipped = loss1 < loss2
    dual = torch.zeros_like(mask)
    if c_clip is not None:
        dual_bound = -c_clip * adv
        dual = (adv < 0) & (dual_bound < tok_loss)
        tok_loss = torch.where(dual, dual_bound, tok_loss)

    stats: dict[str, torch.Tensor] = {}
    keep = mask
    if behave_logp is not None:
        w, keep = _behaviour_weight(
            old_logp, behave_logp, mask, imp_weight_cap, rejection, seq_ids, n_seqs
        )
        tok_loss = tok_loss * w
        stats["imp_weight_mean"] = masked_mean(w, keep).detach()
        stats["imp_weight_max"] = torch.where(keep, w, -torch.inf).max().detach()
        stats["imp_weight_min"] = torch.where(keep, w, torch.inf).min().detach()
        stats["rejected_frac"] = masked_mean((mask & ~keep).float(), mask)
    elif rejection != "none":
        raise ValueError(
            f"rejection={rejection!r} bounds the behaviour importance weight, which needs the "
            "decoupled loss (pass behave_logp / set use_decoupled_loss)"
        )

    n = keep.sum() if n_tokens is None else n_tokens
    if isinstance(n, torch.Tensor):
        n = n.to(tok_loss.device, torch.float32)
    loss = torch.where(keep, tok_loss, 0.0).sum() / n
    stats["clip_frac"] = masked_mean(clipped.float(), keep)
    stats["dual_clip_frac"] = masked_mean(dual.float(), keep)
    stats["approx_kl"] = masked_mean(-log_ratio, keep).detach()
    stats["n_tokens"] = keep.sum().float()
    return loss, stats


def _behaviour_weight(
    prox_logp: torch.Tensor,
    behave_logp: torch.Tensor,
    mask: torch.Tensor,
    cap: float | None,
    rejection: Rejection,
    seq_ids: torch.Tensor | None = None,
    n_seqs: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w = exp(prox - behave), a constant; rejection "none" truncates it to min(w, cap), the
    other modes apply their rule on the bounds [1/cap, cap]."""
    log_w = torch.where(mask, prox_logp.float() - behave_logp.float(), 0.0).detach()
    w = torch.exp(log_w)
    if cap is not None and cap <= 1.0:
        raise ValueError(f"the behaviour importance-weight cap must be > 1, got {cap}")
    if rejection == "none":
        return (w if cap is None else w.clamp(max=cap)), mask
    if cap is None:
        raise ValueError(
            f"rejection={rejection!r} needs bounds: set the importance-weight cap "
            "(actor.behav_imp_weight_cap) to a value > 1"
        )
    return reject_by_ratio(
        w, mask, low=1.0 / cap, high=cap, mode=rejection, seq_ids=seq_ids, n_seqs=n_seqs
    )
