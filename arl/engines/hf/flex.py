"""Length-aware decode attention of the hf engine: torch's ``flex_attention`` with a block mask
built from each row's own length.

With the additive mask (`grouped_decode_attention`) a decode step reads every row's KV cache up
to the batch's longest row. Here row ``b`` sees KV blocks ``0 .. ceil(len_b / block) - 1`` only,
so the kernel (FlexDecoding on CUDA) never loads the blocks past a row's length: a step reads
about the rows' own lengths, whatever width the batch runs at. Inside a block the mask ``kv_idx <
len_b`` applies, so positions past a row's length inside its last block are read and masked
(they are finite: zeros, or keys and values of a row's earlier request).

Everything a step reads lives in buffers of fixed address, updated in place from the engine's
position buffer by the step itself (two small kernels), so the step can be replayed from a CUDA
graph: the per-row lengths (read by the mask function), the per-row block counts, and per shape
one constant block-index table. `BlockMask.from_kv_blocks` wraps them once per (rows, width).

``flex_attention`` is fused only under ``torch.compile``; `flex_decode` compiles it (a shape per
batch bucket and width, kept under ``ARL_CACHE`` by `arl.precompile` so that a later run loads
them) and checks that it works on this machine, or returns None so that the engine keeps SDPA.
Uncompiled (the CPU default) it runs torch's reference, which applies the mask to every
position: correct, but it reads the whole width.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from arl.engines.hf.attention import grouped_decode_attention
from arl.engines.hf.graphs import row_bucket
from arl.engines.hf.kv_cache import SlotKVCache
from arl.engines.hf.split_decode import split_decode_attention
from arl.precompile import first_line, precompiled

logger = logging.getLogger(__name__)

DECODE_ATTENTIONS = ("auto", "sdpa", "flex", "triton")

# KV positions per block: the FlexDecoding kernel's own tile (BLOCK_N = 64), so a row reads at
# most 63 positions past its length and no tile is split between blocks.
KV_BLOCK = 64
# The query "block" holds a KV head's group of query heads (see `flex_decode_attention`): it
# must be a multiple of the kernel's BLOCK_M (16), and one block covers any group up to 128.
_Q_BLOCK = 128

# Each (batch bucket, width) is its own compiled kernel: FlexDecoding needs a static batch size,
# and a batch of symbolic size would take the general kernel, which pads one query to 128 rows.
# The engine has up to ~14 batch buckets, over dynamo's default limit of 8 recompiles.
_RECOMPILE_LIMIT = 256
_COMPILED: Any = None
# The transposed (query-block) tables only serve the backward pass; skip building them where
# this torch can.
_NO_Q_BLOCKS = (
    {"compute_q_blocks": False}
    if "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters
    else {}
)


class FlexDecodeMask:
    """Per-row lengths and KV block counts of up to ``max_rows`` decode rows, at fixed addresses,
    and the `BlockMask` of each (rows, width) built on them."""

    def __init__(self, max_rows: int, groups: int, device: torch.device, block: int = KV_BLOCK):
        self.block, self.groups, self.device = block, groups, device
        self.lens = torch.ones(max_rows, dtype=torch.int32, device=device)
        self.num_blocks = torch.ones(max_rows, 1, 1, dtype=torch.int32, device=device)
        self._masks: dict[tuple[int, int], BlockMask] = {}
        lens = self.lens

        def mask_mod(
            b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor
        ) -> torch.Tensor:
            return kv < lens[b]

        self._mask_mod = mask_mod

    def update(self, pos: torch.Tensor) -> None:
        """Rows ``0..len(pos)-1`` attend to positions ``0..pos`` (their new token's included)."""
        rows = pos.shape[0]
        torch.add(pos, 1, out=self.lens[:rows])
        torch.floor_divide(pos + self.block, self.block, out=self.num_blocks[:rows, 0, 0])

    def block_mask(self, rows: int, width: int) -> BlockMask:
        """The mask of ``rows`` rows over a KV cache of ``width`` positions (a multiple of the
        block), reading the buffers `update` writes; one object per shape, built once."""
        mask = self._masks.get((rows, width))
        if mask is None:
            if width % self.block:
                raise ValueError(f"KV width {width} is not a multiple of the block {self.block}")
            n = width // self.block
            # Blocks are taken in order, so the index table is constant: row b reads blocks
            # 0..num_blocks[b]-1 and never the rest of its row of the table.
            indices = torch.arange(n, dtype=torch.int32, device=self.device)
            indices = indices.expand(rows, 1, 1, n).contiguous()
            # No "full" blocks (those that skip the mask function): with them the kernel splits
            # a row's work over its programs by the whole width instead of by the row's blocks,
            # and the mask costs a compare per position of a step that is bound by its reads.
            mask = BlockMask.from_kv_blocks(
                self.num_blocks[:rows],
                indices,
                BLOCK_SIZE=(_Q_BLOCK, self.block),
                mask_mod=self._mask_mod,
                seq_lengths=(self.groups, width),
                **_NO_Q_BLOCKS,
            )
            self._masks[(rows, width)] = mask
        return mask


def _flex_call(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: BlockMask, scale: float
) -> torch.Tensor:
    return flex_attention(query, key, value, block_mask=mask, scale=scale)


def _run_compiled(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: BlockMask, scale: float
) -> torch.Tensor:
    global _COMPILED
    if _COMPILED is None:
        # Kept under ARL_CACHE (arl.precompile): a later run loads each shape's kernel instead
        # of tracing flex_attention again (the mask function is this file's: its hash is in the
        # key).
        _COMPILED = precompiled(
            _flex_call, name="hf.flex_decode", dynamic=False, max_compiled=_RECOMPILE_LIMIT
        )
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    with config.patch({name: max(getattr(config, name), _RECOMPILE_LIMIT)}):
        return _COMPILED(query, key, value, mask, scale)


def compiled_flex_function() -> Any:
    """The compiled flex attention of this process (a `Precompiled`, or torch.compile's), or
    None before the first compiled step."""
    return _COMPILED


_BROKEN = False  # compiled flex failed at a shape after the build's probe passed


def _compiled_flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: BlockMask, scale: float
) -> torch.Tensor:
    global _BROKEN
    if not _BROKEN:
        try:
            return _run_compiled(query, key, value, mask, scale)
        except Exception as exc:  # noqa: BLE001 - a shape the build's probe did not cover
            # Compilation runs in the eager passes before a graph is captured, so the reference
            # can stand in from here on: slower (it reads every position), but rollout goes on.
            why, shape = first_line(exc), tuple(query.shape)
            logger.warning("compiled flex_attention failed at %s (%s); eager from here", shape, why)
            _BROKEN = True
    return _eager_flex(query, key, value, mask, scale)


def _eager_flex(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: BlockMask, scale: float
) -> torch.Tensor:
    return flex_attention(query, key, value, block_mask=mask, scale=scale)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, BlockMask, float], torch.Tensor]


class SplitAttend:
    """An `Attend` through `split_decode_attention`: reads the per-row lengths ``lens`` (the
    mask's buffer) and ignores the block mask."""

    def __init__(self, lens: torch.Tensor) -> None:
        self.lens = lens

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, _: Any, scale: float
    ) -> torch.Tensor:
        return split_decode_attention(query, key, value, self.lens, scale)


def flex_decode_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | BlockMask | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    flex_attend: Attend | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Decode steps (a `BlockMask`) through ``flex_attend``; prefill (a tensor mask) through SDPA.

    The query heads sharing a KV head stand in the query-length dimension, as in
    `grouped_decode_attention`: the kernel reads each KV head once for its whole group, for any
    group size (``enable_gqa`` takes FlexDecoding only for a power-of-two group; SmolLM2's is 3).
    """
    if not isinstance(attention_mask, BlockMask) or flex_attend is None:
        return grouped_decode_attention(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    packed = query.reshape(rows, kv_heads, heads // kv_heads, dim)  # head h: KV head h // group
    scale = scaling if scaling is not None else dim**-0.5
    out = flex_attend(packed, key, value, attention_mask, scale)
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


_ATTENTION = "arl_flex_decode"


def register_flex_attention() -> str:
    """Register `flex_decode_attention` with transformers; returns its implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTENTION, flex_decode_attention)
    return _ATTENTION


def head_shape(config: Any) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of a transformers model config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, dim


def warm_up_width(max_rows: int, max_seq_len: int, length: int) -> int:
    """The KV width every decode graph of a flex engine runs at after a warm-up to ``length``
    positions: the capacity its cache takes for ``max_rows`` rows of that length."""
    sized = SlotKVCache(max_rows, max_seq_len, KV_BLOCK)  # allocates nothing
    sized.reserve(max_rows, min(length, max_seq_len))
    return sized.seq_capacity


def flex_decode(
    model: Any,
    device: torch.device,
    max_rows: int,
    compiled: bool,
    width: int = KV_BLOCK,
    kernel: str = "flex",
) -> tuple[FlexDecodeMask, Attend] | None:
    """The block-mask buffers and the attention call of a length-aware engine, or None (with a
    warning) where the compiled kernel fails on this machine: the engine then keeps SDPA.

    ``kernel="triton"`` attends with `arl.engines.hf.split_decode` (one Triton kernel for every
    row bucket, reading the mask's per-row lengths) where it runs on this machine, and falls
    back to compiled flex (with a warning) where it does not; ``"flex"`` with compiled
    ``flex_attention``, one kernel per row bucket.

    The Triton kernel, and flex where ``compiled``, run the attention of a decode step of the
    smallest row bucket at ``width`` KV positions now (on the returned mask: a step of that shape
    later reuses what this compiled), so that a machine without Triton or a C++ compiler falls
    back here rather than a generation step later. Uncompiled flex is torch's reference.
    """
    heads, kv_heads, dim = head_shape(model.config)
    mask = FlexDecodeMask(max_rows, heads // kv_heads, device)
    param = next(model.parameters())
    rows = row_bucket(1, max_rows)
    mask.update(torch.full((rows,), KV_BLOCK // 2, device=device))
    q = torch.zeros(rows, kv_heads, heads // kv_heads, dim, dtype=param.dtype, device=device)
    # Keys and values apart, as a step passes them: aliased inputs compile separately.
    k = torch.zeros(rows, kv_heads, width, dim, dtype=param.dtype, device=device)
    if kernel == "triton":
        try:
            # Both variants a step may launch: one split a row, and several with their merge.
            for splits in (1, 2):
                split_decode_attention(q, k, torch.zeros_like(k), mask.lens, dim**-0.5, splits)
            torch.cuda.synchronize(device)
        except Exception as exc:  # noqa: BLE001 - any Triton failure: keep flex
            why = first_line(exc)
            logger.warning("the Triton decode attention failed (%s); decoding with flex", why)
        else:
            return mask, SplitAttend(mask.lens)
    if not compiled:
        logger.info("flex decode attention uncompiled: torch's reference reads every position")
        return mask, _eager_flex
    try:
        with torch.no_grad():
            _run_compiled(q, k, torch.zeros_like(k), mask.block_mask(rows, width), dim**-0.5)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: keep SDPA
        why = first_line(exc)
        logger.warning("torch.compile of flex_attention failed (%s); decoding with SDPA", why)
        return None
    return mask, _compiled_flex
