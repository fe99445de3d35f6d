"""Attention and compiled blocks of the hf engine: grouped-query decode attention without KV
copies, ``torch.compile`` of the norm and MLP blocks, and the cache keyword of the model."""

from __future__ import annotations

import inspect
import logging
import types
from typing import Any

import torch

from arl.precompile import precompiled

logger = logging.getLogger(__name__)


def grouped_decode_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA that decodes grouped-query heads without copying the KV cache.

    transformers' sdpa path repeats every key/value head ``num_key_value_groups`` times before
    calling SDPA whenever a mask is given, which is every decode step of this engine: per layer a
    copy of the whole cache, three times its size for SmolLM2. With one query token per row the
    query heads sharing a KV head can instead stand in the query-length dimension, so SDPA reads
    each cached key and value once. Prefill (several query tokens) takes the stock path.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, _, dim = query.shape
    packed = query.reshape(rows, heads // groups, groups, dim)  # head h reads KV head h // groups
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


_ATTENTION = "arl_grouped_decode"


def register_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTENTION, grouped_decode_attention)
    return _ATTENTION


def compile_norm_and_mlp(model: Any) -> int:
    """``torch.compile`` the forward of every RMSNorm and MLP block of ``model`` in place (one
    compiled function per block class, kept under ``ARL_CACHE`` by `arl.precompile`).

    Each distinct block runs here on dummy inputs of every (rows, tokens) kind the engine
    feeds it: one or several rows, one token (decode) or several (prefill). The compiler
    specialises sizes 1 apart from the rest, so a kind first met in serving would compile
    there (~1-4 s inside the first one-row prefill). A machine where compilation cannot work
    (no Triton, no compiler) falls back to eager blocks now, with a warning, rather than failing
    a generation step later. Returns how many blocks were compiled.
    """
    blocks = [
        m
        for m in model.modules()
        if type(m).__name__.endswith(("RMSNorm", "MLP")) and "forward" not in vars(m)
    ]
    if not blocks:
        return 0
    # One compiled forward per block class, with the block as its first argument, kept under
    # ARL_CACHE (arl.precompile): a later run loads it instead of tracing it again.
    kept: dict[type, Any] = {}
    for m in blocks:
        cls = type(m)
        if cls not in kept:
            kept[cls] = precompiled(cls.forward, name=f"hf.block.{cls.__name__}", dynamic=True)
        m.forward = types.MethodType(kept[cls], m)
    try:
        hidden = model.config.hidden_size
        param = next(model.parameters())
        with torch.no_grad():
            for rows, tokens in ((2, 3), (1, 1), (2, 1), (1, 3)):
                probe = torch.zeros(rows, tokens, hidden, dtype=param.dtype, device=param.device)
                for kind in {type(m) for m in blocks}:
                    next(m for m in blocks if type(m) is kind)(probe)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: keep the eager blocks
        logger.warning("torch.compile of the norm/MLP blocks failed (%r); running eagerly", exc)
        for m in blocks:
            del m.forward
        return 0
    return len(blocks)


def cache_kwarg(fn: Any) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; pass whichever fn takes."""
    params = inspect.signature(fn).parameters
    return "cache" if "cache" in params else "past_key_values"
