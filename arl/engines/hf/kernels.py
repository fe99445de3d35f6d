"""Two Triton kernels of the hf engine's decode step on CUDA, each one launch where inductor's
code or torch's ops took several:

- `rope_store`: after a layer's q/k/v projection, the Qwen3 q/k norms, the rotary embedding
  of q and k, and the write of k and v into the layer's KV cache at each token's row and
  position. Compiled from the fused function, this was three kernels a layer (q's rotary, k's
  rotary into a stacked buffer, and a scatter of that buffer into the cache), ~29 us a layer at
  batch 256 on an H100 for ~1 MB of data (docs/results.md).
- `sample_plain`: one token per row from softmax(logits / T) and its log-prob, for rows that do
  not truncate (top-p/top-k): a first pass over each row's logits for its maximum, the sum of
  exponentials and its argmax; a second (sampling rows only) that inverts the cumulative
  distribution with the row's uniform number, as `arl.engines.hf.sampling` does. Torch's ops
  took ten kernels and five passes over [rows, vocab] float32 logits (~0.33 ms a step at batch
  256, vocabulary 49k).

Both compute in float32 and round once at the store, as inductor's code does; the engine's
CPU path and any machine without Triton keep the torch code (`available`).
"""

from __future__ import annotations

import os

import torch

try:  # Triton comes with CUDA builds of torch; a CPU build has none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None
    tl = None

# Set to 0 to keep torch's code on CUDA too (to compare, or to rule the kernels out).
ENV = "ARL_HF_KERNELS"


def triton_on(device: torch.device | str, env: str) -> bool:
    """Whether Triton kernels can run on ``device``: a CUDA device, Triton importable, and the
    environment variable ``env`` (the kernels' off switch) not ``0``."""
    return (
        triton is not None
        and torch.device(device).type == "cuda"
        and os.environ.get(env, "1") != "0"
    )


def available(device: torch.device | str) -> bool:
    """Whether these kernels run on ``device`` (`triton_on`, ``ARL_HF_KERNELS``)."""
    return triton_on(device, ENV)


if triton is not None:

    @triton.jit
    def _rope_store_kernel(
        qkv_ptr,
        qkv_stride,
        cos_ptr,
        sin_ptr,
        cs_stride,
        q_norm_ptr,
        k_norm_ptr,
        q_ptr,
        kv_ptr,
        kv_stride_which,
        kv_stride_row,
        kv_stride_head,
        kv_stride_pos,
        rows_ptr,
        pos_ptr,
        eps,
        HEADS: tl.constexpr,
        KV_HEADS: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HEADS: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        NORM: tl.constexpr,
    ):
        # One program per token: every head of its q, k and v ([heads + 2 kv_heads, dim] in
        # the projection's output), each head as its two halves (the rotary pairs d, d + half).
        tok = tl.program_id(0).to(tl.int64)
        dim = 2 * HALF
        h = tl.arange(0, BLOCK_HEADS)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        in_dim = d < HALF
        live = (h < HEADS + 2 * KV_HEADS) & in_dim
        src = qkv_ptr + tok * qkv_stride + h * dim + d
        x1 = tl.load(src, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=live, other=0.0).to(tl.float32)
        is_q = h < HEADS
        is_k = (h >= HEADS) & (h < HEADS + KV_HEADS)
        rotated = h < HEADS + KV_HEADS
        if NORM:
            # The family's RMSNorm over each q and k head: float32 statistics, the normalised
            # value cast to the model's dtype, then the weight.
            mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1))[:, None] / dim
            inv = tl.rsqrt(mean_sq + eps)
            wq1 = tl.load(q_norm_ptr + d, mask=in_dim, other=0.0).to(tl.float32)
            wq2 = tl.load(q_norm_ptr + HALF + d, mask=in_dim, other=0.0).to(tl.float32)
            wk1 = tl.load(k_norm_ptr + d, mask=in_dim, other=0.0).to(tl.float32)
            wk2 = tl.load(k_norm_ptr + HALF + d, mask=in_dim, other=0.0).to(tl.float32)
            elt = qkv_ptr.dtype.element_ty
            n1 = (x1 * inv).to(elt).to(tl.float32) * tl.where(is_q, wq1, wk1)
            n2 = (x2 * inv).to(elt).to(tl.float32) * tl.where(is_q, wq2, wk2)
            x1 = tl.where(rotated, n1, x1)
            x2 = tl.where(rotated, n2, x2)
        cs = tok * cs_stride + d
        c1 = tl.load(cos_ptr + cs, mask=in_dim, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs + HALF, mask=in_dim, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs, mask=in_dim, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs + HALF, mask=in_dim, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
        y1 = tl.where(rotated, x1 * c1 - x2 * s1, x1)
        y2 = tl.where(rotated, x2 * c2 + x1 * s2, x2)
        # q heads to the q output [tokens, heads, dim]
        q_dst = q_ptr + tok * (HEADS * dim) + h * dim + d
        q_mask = is_q & in_dim
        out = q_ptr.dtype.element_ty
        tl.store(q_dst, y1.to(out), mask=q_mask)
        tl.store(q_dst + HALF, y2.to(out), mask=q_mask)
        # k and v heads to the cache [2, rows, kv_heads, positions, dim] at the token's row
        # and position
        row = tl.load(rows_ptr + tok).to(tl.int64)
        pos = tl.load(pos_ptr + tok).to(tl.int64)
        which = tl.where(is_k, 0, 1).to(tl.int64)
        kv_head = tl.where(is_k, h - HEADS, h - HEADS - KV_HEADS).to(tl.int64)
        c_dst = (
            kv_ptr
            + which * kv_stride_which
            + row * kv_stride_row
            + kv_head * kv_stride_head
            + pos * kv_stride_pos
            + d
        )
        c_mask = live & (h >= HEADS)
        cache = kv_ptr.dtype.element_ty
        tl.store(c_dst, y1.to(cache), mask=c_mask)
        tl.store(c_dst + HALF, y2.to(cache), mask=c_mask)

    @triton.jit
    def _sample_kernel(
        logits_ptr,
        logits_stride,
        vocab,
        temp_ptr,
        u_ptr,
        greedy_ptr,
        tok_ptr,
        logp_ptr,
        SAMPLE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * logits_stride
        temp = tl.load(temp_ptr + row)
        offs = tl.arange(0, BLOCK)
        neg_inf = float("-inf")
        # Pass 1: the running maximum m, the sum s of exp(x - m) and the (first) argmax of
        # x = logits / T, online over blocks of the vocabulary.
        m = tl.full([], neg_inf, tl.float32)
        s = tl.full([], 0.0, tl.float32)
        best = tl.full([], 0, tl.int64)
        for start in range(0, vocab, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < vocab, other=neg_inf).to(tl.float32) / temp
            block_max = tl.max(x, axis=0)
            block_arg = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
            best = tl.where(block_max > m, block_arg, best)
            new_m = tl.maximum(m, block_max)
            # exp(-inf - -inf) is NaN: a block (or the rows so far) of -inf only adds nothing
            scale = tl.where(m == new_m, 1.0, tl.exp(m - new_m))
            w = tl.where(x == neg_inf, 0.0, tl.exp(x - new_m))
            s = s * scale + tl.sum(w, axis=0)
            m = new_m
        lse = m + tl.log(s)
        tok = best
        if SAMPLE:
            if tl.load(greedy_ptr + row) == 0:
                # Pass 2: the first token whose cumulative weight reaches u * s, with u in
                # (0, 1]. Weights are exp(x - m) as in pass 1; a cumulative sum that rounds
                # below u * s at the end takes the last token of positive weight.
                target = tl.load(u_ptr + row) * s
                acc = tl.full([], 0.0, tl.float32)
                found = tl.full([], 0, tl.int32)
                chosen = tl.full([], 0, tl.int64)
                last = tl.full([], 0, tl.int64)
                for start in range(0, vocab, BLOCK):
                    idx = start + offs
                    x = tl.load(base + idx, mask=idx < vocab, other=neg_inf).to(tl.float32)
                    x = x / temp
                    w = tl.where(x == neg_inf, 0.0, tl.exp(x - m))
                    cdf = acc + tl.cumsum(w, axis=0)
                    below = tl.sum((cdf < target).to(tl.int64), axis=0)
                    hit = (found == 0) & (below < BLOCK) & (start + below < vocab)
                    chosen = tl.where(hit, start + below, chosen)
                    found = tl.where(hit, 1, found)
                    last = tl.maximum(last, tl.max(tl.where(w > 0, idx, 0).to(tl.int64), axis=0))
                    acc = tl.max(tl.where(idx < vocab, cdf, 0.0), axis=0)
                tok = tl.where(found == 1, chosen, last)
        x_tok = tl.load(base + tok).to(tl.float32) / temp
        tl.store(tok_ptr + row, tok)
        tl.store(logp_ptr + row, x_tok - lse)


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    kv: torch.Tensor,
    kv_rows: torch.Tensor,
    kv_pos: torch.Tensor,
    heads: int,
    kv_heads: int,
    dim: int,
) -> torch.Tensor:
    """q [n, heads, dim] of a layer's projection ``qkv`` [n, (heads + 2 kv_heads) * dim] after
    the q norm (``q_norm``, with ``k_norm``: both or neither) and the rotary embedding (``cos``,
    ``sin``: [n, ..., dim] rows); token j's normed, rotated key and its value go into the cache
    ``kv`` [2, rows, kv_heads, positions, dim] at row ``kv_rows[j]``, position ``kv_pos[j]``."""
    n = qkv.shape[0]
    if dim % 2:
        raise ValueError(f"rope_store needs an even head dim, not {dim}")
    if qkv.stride(-1) != 1 or kv.stride(-1) != 1:
        raise ValueError("rope_store needs the projection's and the cache's last dim contiguous")
    cos, sin = cos.reshape(n, dim), sin.reshape(n, dim)
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty((n, heads, dim), dtype=qkv.dtype, device=qkv.device)
    norm = q_norm is not None and k_norm is not None
    _rope_store_kernel[(n,)](
        qkv,
        qkv.stride(0),
        cos,
        sin,
        cos.stride(0),
        q_norm if norm else qkv,
        k_norm if norm else qkv,
        q,
        kv,
        kv.stride(0),
        kv.stride(1),
        kv.stride(2),
        kv.stride(3),
        kv_rows,
        kv_pos,
        eps,
        HEADS=heads,
        KV_HEADS=kv_heads,
        HALF=dim // 2,
        BLOCK_HEADS=triton.next_power_of_2(heads + 2 * kv_heads),
        BLOCK_HALF=triton.next_power_of_2(dim // 2),
        NORM=norm,
    )
    return q


_SAMPLE_BLOCK = 2048


def sample_plain(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    greedy: torch.Tensor,
    generator: torch.Generator,
    *,
    all_greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`arl.engines.hf.sampling.sample_rows` for rows that do not truncate: tokens [n] (int64)
    and their log-probs [n] under log_softmax(logits / T). Draws one uniform number per row from
    ``generator`` unless ``all_greedy``, as the torch code does."""
    n, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(n, dtype=torch.long, device=logits.device)
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    if all_greedy:
        u, flags = temperature, temperature  # unread
    else:
        u = 1.0 - torch.rand((n,), generator=generator, device=logits.device)
        flags = greedy.to(torch.int8)
    _sample_kernel[(n,)](
        logits,
        logits.stride(0),
        vocab,
        temperature.float(),
        u,
        flags,
        tokens,
        logp,
        SAMPLE=not all_greedy,
        BLOCK=_SAMPLE_BLOCK,
        num_warps=8,
    )
    return tokens, logp
