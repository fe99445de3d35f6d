"""Per-token advantages: GRPO (sequence reward on every completion token) and GAE."""

from __future__ import annotations

import torch
import torch.distributed as dist

from arl.algo.normalize import Level, masked_normalize


def grpo_advantages(norm_rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """A[i, t] = r_hat_i * m[i, t]: the normalised sequence reward on each completion token."""
    return norm_rewards[:, None].float() * loss_mask.float()


def last_token_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last True of each row of ``loss_mask`` [B, L]; -1 for a row with none."""
    pos = torch.arange(loss_mask.shape[1], device=loss_mask.device).expand_as(loss_mask)
    return torch.where(loss_mask.bool(), pos, -1).max(dim=1).values


def token_rewards(
    seq_rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_ctl: float = 0.0,
) -> torch.Tensor:
    """r[i, t] = -kl_ctl * kl[i, t] * m[i, t] + R_i * [t == last completion token of row i].

    The KL-in-reward shaping of InstructGPT/AReaL: the sequence reward lands on the final token,
    the KL penalty on every completion token.
    """
    mask = loss_mask.bool()
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if kl is not None and kl_ctl != 0.0:
        out = out - kl_ctl * torch.where(mask, kl.float(), 0.0)
    last = last_token_index(mask)
    rows = torch.nonzero(last >= 0).squeeze(1)
    out[rows, last[rows]] += seq_rewards[rows].float()
    return out


def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over the masked tokens of each row; returns (advantages, returns = A + V).

    delta_t = r_t + gamma * V_{t'} - V_t,  A_t = delta_t + gamma * lam * A_{t'}, where t' is the
    next masked token of the row (V = A = 0 after the last); unmasked tokens (prompt, tool
    output) are skipped and get A = 0.
    """
    mask = loss_mask.bool()
    r, v = rewards.float(), values.float()
    adv = torch.zeros_like(r)
    next_v = torch.zeros(r.shape[0], device=r.device)
    next_a = torch.zeros_like(next_v)
    for t in range(r.shape[1] - 1, -1, -1):
        m = mask[:, t]
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * next_a
        adv[:, t] = torch.where(m, a, 0.0)
        next_v = torch.where(m, v[:, t], next_v)
        next_a = torch.where(m, a, next_a)
    return adv, torch.where(mask, adv + v, 0.0)


def normalize_advantages(
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    mean_level: Level = "batch",
    std_level: Level = "batch",
    group_ids: torch.Tensor | None = None,
    eps: float = 1e-5,
    unbiased: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """A_hat = (A - mu) / (sigma + eps) over completion tokens; mu/sigma per group or batch.

    "batch" moments are all-reduced over every rank when torch.distributed is initialised, so
    dp=2 gives the same advantages as dp=1 on the whole batch.
    """
    return masked_normalize(
        advantages,
        loss_mask.bool(),
        mean_level=mean_level,
        std_level=std_level,
        group_ids=group_ids,
        eps=eps,
        unbiased=unbiased,
        process_group=process_group,
    )
