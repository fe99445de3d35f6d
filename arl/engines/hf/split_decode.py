"""Decode attention of the hf engine on CUDA as one Triton kernel that reads each row's own
length: the "split-KV" decode kernel of the serving engines, written for the engine's slot cache.

A decode step attends one query token a row (``G`` query heads a KV head) to the row's first
``len_b`` cached positions. The kernel runs one program per (row, KV head, split): the program
loads the KV head's group of queries as one ``[G_PAD, D]`` tile (G padded to 16, the smallest
``tl.dot``), walks its split of the row's positions ``BLOCK_N`` at a time (a masked load past the
row's length fetches nothing) with an online softmax, and writes its normalised output and
log-sum-exp. Where a step has too few (row, KV head) pairs to fill the GPU, a row's positions are
split over several programs and a second, small kernel merges the splits by their log-sum-exps.

Against compiled ``flex_attention`` (`arl.engines.hf.flex`), which reads the same positions:
FlexDecoding needs a static batch size, so inductor compiled one kernel per row bucket (10.6 s
of a cold start on an H100, docs/results.md); this kernel's shapes and split count are launch
arguments, so Triton compiles it once per (head group, head dim, dtype) in three variants (one
split, several, and their merge), and a graph of any row bucket launches them. The lengths come
from `FlexDecodeMask.lens`, written inside the step, so a CUDA graph replays it.

On one H100, one layer of SmolLM2-135M at batch 256 with mixed lengths: 51.4 us at 90% of the
read floor, against flex's 61.9 us and FlashInfer's tensor-core decode kernel's 54.9 us (measured
in session 31, which also needs a host ``plan`` before every step, a 101 MB dependency and an
nvcc build at first use); docs/results.md has the smaller batches.
"""

from __future__ import annotations

import functools

import torch

from arl.engines.hf.kernels import tl, triton, triton_on

# Set to 0 to keep compiled flex attention on CUDA (to compare, or to rule this kernel out).
ENV = "ARL_SPLIT_DECODE"
# Positions a program reads per iteration: FlexDecoding's own tile.
BLOCK_N = 64
# Aim for this many programs per streaming multiprocessor before splitting a row's positions.
_PROGRAMS_PER_SM = 4
_MAX_SPLITS = 8


def available(device: torch.device | str) -> bool:
    """Whether the kernel runs on ``device`` (`arl.engines.hf.kernels.triton_on`,
    ``ARL_SPLIT_DECODE``)."""
    return triton_on(device, ENV)


if triton is not None:

    @triton.jit
    def _split_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        lens_ptr,
        out_ptr,
        part_ptr,
        lse_ptr,
        q_stride_row,
        q_stride_head,
        q_stride_group,
        k_stride_row,
        k_stride_head,
        k_stride_pos,
        v_stride_row,
        v_stride_head,
        v_stride_pos,
        scale_log2,
        splits,
        G: tl.constexpr,
        D: tl.constexpr,
        G_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        split = tl.program_id(2)
        kv_heads = tl.num_programs(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        n = tl.arange(0, BLOCK)
        length = tl.load(lens_ptr + row)
        # Each split takes a whole number of blocks of the row's positions.
        per_split = tl.cdiv(tl.cdiv(length, splits), BLOCK) * BLOCK
        start = split * per_split
        end = tl.minimum(length, start + per_split)

        q_mask = (g[:, None] < G) & (d[None, :] < D)
        q_src = q_ptr + row * q_stride_row + head * q_stride_head
        q = tl.load(q_src + g[:, None] * q_stride_group + d[None, :], mask=q_mask, other=0.0)
        k_src = k_ptr + row * k_stride_row + head * k_stride_head + d[None, :]
        v_src = v_ptr + row * v_stride_row + head * v_stride_head + d[None, :]
        in_dim = d[None, :] < D

        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for first in tl.range(start, end, BLOCK):
            pos = first + n
            live = pos < end
            k = tl.load(k_src + pos[:, None] * k_stride_pos, mask=live[:, None] & in_dim, other=0.0)
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = tl.where(live[None, :], qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_src + pos[:, None] * v_stride_pos, mask=live[:, None] & in_dim, other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        # A split past the row's length read nothing: output 0, log-sum-exp -inf (weight 0).
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if splits == 1:  # Triton specialises an argument of 1: a variant of its own
            dst = out_ptr + ((row * kv_heads + head) * G + g[:, None]) * D + d[None, :]
            tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            at = (row * kv_heads + head) * splits + split
            tl.store(part_ptr + (at * G_PAD + g[:, None]) * D_PAD + d[None, :], out)
            tl.store(lse_ptr + at * G_PAD + g, m_i + tl.log2(l_i))

    @triton.jit
    def _merge_kernel(
        part_ptr,
        lse_ptr,
        out_ptr,
        splits,
        G: tl.constexpr,
        D: tl.constexpr,
        G_PAD: tl.constexpr,
        D_PAD: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        kv_heads = tl.num_programs(1)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D_PAD)
        first = (row * kv_heads + head) * splits
        # Split 0 always holds the row's first position, so the maximum is finite.
        m = tl.full([G_PAD], float("-inf"), tl.float32)
        for s in range(splits):
            m = tl.maximum(m, tl.load(lse_ptr + (first + s) * G_PAD + g))
        total = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for s in range(splits):
            w = tl.exp2(tl.load(lse_ptr + (first + s) * G_PAD + g) - m)
            part = tl.load(part_ptr + ((first + s) * G_PAD + g[:, None]) * D_PAD + d[None, :])
            total += w
            acc += w[:, None] * part
        out = acc / total[:, None]
        dst = out_ptr + ((row * kv_heads + head) * G + g[:, None]) * D + d[None, :]
        mask = (g[:, None] < G) & (d[None, :] < D)
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_for(rows: int, kv_heads: int, width: int, multiprocessors: int) -> int:
    """How many programs share a row's positions: enough (row, KV head, split) programs for
    ``_PROGRAMS_PER_SM`` a multiprocessor, a power of two, at most one per ``BLOCK_N`` positions
    of ``width`` and at most ``_MAX_SPLITS``."""
    want = -(-_PROGRAMS_PER_SM * multiprocessors // max(1, rows * kv_heads))
    cap = max(1, min(_MAX_SPLITS, width // BLOCK_N))
    return min(cap, 1 << max(0, want - 1).bit_length())


def split_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    block: int = BLOCK_N,
) -> torch.Tensor:
    """Attention of ``query`` ``[rows, KV heads, G, D]`` (the G query heads of each KV head) to
    the first ``lens[b]`` positions of row ``b`` of ``key``/``value`` ``[rows, KV heads, width,
    D]`` (any strides but a contiguous last dimension): ``[rows, KV heads, G, D]`` in the query's
    dtype. ``lens`` (int32, at least ``rows`` long) is read on the GPU, so a CUDA graph of the
    call follows the lengths written before each replay."""
    rows, kv_heads, group, dim = query.shape
    width = key.shape[2]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("split_decode_attention needs keys and values contiguous in head dim")
    if splits is None:
        splits = splits_for(rows, kv_heads, width, _multiprocessors(query.device))
    g_pad = max(16, triton.next_power_of_2(group))
    d_pad = max(16, triton.next_power_of_2(dim))
    out = torch.empty(rows, kv_heads, group, dim, dtype=query.dtype, device=query.device)
    if splits > 1:
        programs = rows * kv_heads * splits
        part = torch.empty(programs * g_pad * d_pad, dtype=torch.float32, device=query.device)
        lse = torch.empty(programs * g_pad, dtype=torch.float32, device=query.device)
    else:
        part = lse = out  # unread
    _split_kernel[(rows, kv_heads, splits)](
        query,
        key,
        value,
        lens,
        out,
        part,
        lse,
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        scale * 1.4426950408889634,  # exp(x) = exp2(x * log2(e))
        splits,
        G=group,
        D=dim,
        G_PAD=g_pad,
        D_PAD=d_pad,
        BLOCK=block,
        IEEE=query.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _merge_kernel[(rows, kv_heads)](
            part, lse, out, splits, G=group, D=dim, G_PAD=g_pad, D_PAD=d_pad, num_warps=4
        )
    return out
