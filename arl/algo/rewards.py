"""Sequence-reward shaping before advantages: affine transform, clip, normalisation."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from arl.algo.normalize import Level, masked_normalize


def transform_rewards(
    rewards: torch.Tensor, *, bias: float = 0.0, scaling: float = 1.0, clip: float | None = None
) -> torch.Tensor:
    """r' = clip((r + bias) * scaling, -clip, clip); ``clip`` None or inf leaves it unclipped."""
    if clip is not None and clip <= 0:
        raise ValueError(f"reward clip must be positive (or None for no clip), got {clip}")
    out = (rewards + bias) * scaling
    if clip is not None and math.isfinite(clip):
        out = out.clamp(-clip, clip)
    return out


def normalize_rewards(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None,
    *,
    mean_level: Level = "group",
    std_level: Level = "group",
    eps: float = 1e-5,
    unbiased: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """r_hat_i = (r_i - mu) / (sigma + eps), mu/sigma over the sample's group, the batch, or none.

    GRPO uses group/group; Dr. GRPO-style group mean with batch std is mean_level="group",
    std_level="batch". Batch moments include every rank (see `masked_normalize`).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be one value per sequence [B], got shape {rewards.shape}")
    return masked_normalize(
        rewards.float(),
        torch.ones_like(rewards, dtype=torch.bool),
        mean_level=mean_level,
        std_level=std_level,
        group_ids=group_ids,
        eps=eps,
        unbiased=unbiased,
        process_group=process_group,
    )
