"""The statistics of an update, summed on the device over micro-batches (no host syncs)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


class StatSums:
    """Token-weighted sums of micro-batch stats, kept on the device (no per-step host syncs)
    and reduced over ranks once per mini-batch. Every update is in place, so a CUDA graph that
    captured `add` keeps adding into the same sums (`reset` clears them between uses)."""

    def __init__(self, device: torch.device) -> None:
        # loss, entropy, kl, clip_frac, approx_kl, imp_weight_mean, rejected_frac, kept tokens
        self.sums = torch.zeros(8, dtype=torch.float64, device=device)
        self.extremes = torch.full((2,), -math.inf, dtype=torch.float64, device=device)

    def reset(self) -> None:
        """Back to no micro-batches."""
        self.sums.zero_()
        self.extremes.fill_(-math.inf)

    def add(
        self,
        loss: torch.Tensor,
        st: dict[str, torch.Tensor],
        mask: torch.Tensor,
        entropy: torch.Tensor,
        kl: torch.Tensor | None,
    ) -> None:
        kept = st["n_tokens"].double()
        zero = torch.zeros((), device=loss.device)
        self.sums += torch.stack(
            [
                loss.double(),
                torch.where(mask, entropy, 0.0).sum().double(),
                torch.where(mask, kl, 0.0).sum().double() if kl is not None else zero.double(),
                st["clip_frac"] * kept,
                st["approx_kl"] * kept,
                st.get("imp_weight_mean", zero) * kept,
                st.get("rejected_frac", zero) * mask.sum(),
                kept,
            ]
        ).double()
        if "imp_weight_max" in st:
            w = torch.stack([st["imp_weight_max"], -st["imp_weight_min"]]).double()
            torch.maximum(self.extremes, w, out=self.extremes)

    def reduce(self, all_sum: Callable, all_max: Callable, n_tokens: float) -> dict[str, float]:
        """Global stats: loss summed, entropy/kl per loss token, the rest per kept token."""
        s = all_sum(self.sums).tolist()
        e = all_max(self.extremes).tolist()
        denom, kept = max(n_tokens, 1.0), max(s[7], 1.0)
        return {
            "loss": s[0],
            "entropy": s[1] / denom,
            "kl": s[2] / denom,
            "clip_frac": s[3] / kept,
            "approx_kl": s[4] / kept,
            "n_tokens": n_tokens,
            "imp_weight_mean": s[5] / kept,
            "rejected_frac": s[6] / denom,
            "imp_weight_max": e[0],
            "imp_weight_min": -e[1],
        }
