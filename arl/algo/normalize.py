"""Masked mean/std normalisation at group, batch (all ranks) or no level.

Shared by reward normalisation (one value per sequence) and advantage normalisation (one value
per completion token). Batch-level moments are all-reduced as (sum, count, sum of squares) in
float64, so a batch split over dp ranks normalises exactly as the whole batch on one rank.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

Level = Literal["group", "batch", "none"]
LEVELS: tuple[str, ...] = ("group", "batch", "none")


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``t`` in place over the ranks of ``group`` when torch.distributed is initialised."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def _row_sums(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-row [sum, count, sum of squares] over masked entries, float64, shape [B, 3]."""
    xm = torch.where(mask, x.double(), 0.0)
    if xm.dim() == 1:
        xm, m = xm[:, None], mask[:, None]
    else:
        xm, m = xm.flatten(1), mask.flatten(1)
    return torch.stack([xm.sum(1), m.sum(1).double(), (xm * xm).sum(1)], dim=1)


def _moments(
    sums: torch.Tensor, level: str, group_ids: torch.Tensor | None, pg: dist.ProcessGroup | None
) -> torch.Tensor:
    """[B, 3] per-row (sum, count, sumsq) aggregated to the row's level."""
    if level == "group":
        if group_ids is None:
            raise ValueError(
                "normalisation level 'group' needs group_ids (one id per row); got None"
            )
        _, inv = torch.unique(group_ids, return_inverse=True)
        n_groups = int(inv.max()) + 1 if inv.numel() else 0
        per_group = torch.zeros(n_groups, 3, dtype=sums.dtype, device=sums.device)
        per_group.index_add_(0, inv, sums)
        return per_group[inv]
    total = all_reduce_sum(sums.sum(0), pg)
    return total.expand_as(sums)


def _mean_std(m: torch.Tensor, unbiased: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s, n, q = m.unbind(1)
    mean = torch.where(n > 0, s / n.clamp(min=1), 0.0)
    dof = n - 1 if unbiased else n
    var = torch.where(dof > 0, (q - n * mean * mean) / dof.clamp(min=1), 0.0)
    return mean, var.clamp(min=0).sqrt()


def masked_normalize(
    x: torch.Tensor,
    mask: torch.Tensor,
    *,
    mean_level: Level = "batch",
    std_level: Level = "batch",
    group_ids: torch.Tensor | None = None,
    eps: float = 1e-5,
    unbiased: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """y = (x - mu) / (sigma + eps) on masked entries, 0 elsewhere; x is [B] or [B, L].

    mu, sigma are the mean and std of x over the masked entries of the row's group ("group"),
    of the whole batch on all ranks ("batch"), or mu = 0 / sigma = 1 ("none"); sigma is taken about
    its own level's mean: sigma^2 = (sum x^2 - n mu^2) / (n - 1 if unbiased else n), 0 when n <= 1.
    A zero denominator (sigma = eps = 0) is replaced by 1.
    """
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in LEVELS:
            raise ValueError(f"{name} must be one of {LEVELS}, got {level!r}")
    if mask.shape != x.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != x shape {tuple(x.shape)}")
    mask = mask.bool()
    sums = _row_sums(x, mask)
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for level in {mean_level, std_level} - {"none"}:
        cache[level] = _mean_std(_moments(sums, level, group_ids, process_group), unbiased)
    ones = torch.ones(x.shape[0], dtype=torch.float64, device=sums.device)
    mean = cache[mean_level][0] if mean_level != "none" else ones * 0
    denom = cache[std_level][1] + eps if std_level != "none" else ones
    denom = torch.where(denom > 0, denom, 1.0)  # eps = 0 on a constant group: no 0/0
    shape = (-1,) + (1,) * (x.dim() - 1)
    y = (x.double() - mean.view(shape)) / denom.view(shape)
    return torch.where(mask, y, 0.0).to(x.dtype)
