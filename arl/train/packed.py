"""A micro-batch as one packed row on the device, optionally padded to a bucket of sizes.

The batch's per-token fields are [B, L] right-padded rows (`arl.algo.packing`). A micro-batch
(some of those rows) becomes one row of T tokens, each sequence after the other:
``position_ids`` restart at 0 per sequence, ``cu_seqlens`` [S + 1] bounds the sequences for
varlen attention, ``seq_ids`` numbers them (0..S-1) for per-sequence rules, and every per-token
field is gathered into the same [1, T] order. The layout is computed on the host from the rows'
lengths (known there) and reaches the device in one copy; the fields are gathered on the device.

With a `Bucket` the row is padded to the bucket's sizes, so that micro-batches of different
sizes share one shape (`arl.train.graphs` replays one CUDA graph per bucket): the padding is
extra sequences of at most ``max_len`` tokens each, masked out of the loss, and empty sequences
(bounds repeated) fill ``cu_seqlens`` up to ``seqs + 1`` entries. A padding token attends only to
its own padding sequence, so it changes no real token's values or gradients.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch


class Bucket(NamedTuple):
    """The padded sizes of a packed row: tokens, sequences (without the closing bound of
    ``cu_seqlens``) and the longest sequence that varlen attention is told of."""

    tokens: int
    seqs: int
    max_len: int


class PackedMicroBatch(NamedTuple):
    """One packed row on the device; ``fields`` are [1, T] (``loss_mask`` bool)."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    seq_ids: torch.Tensor  # [1, T] int64
    cu_seqlens: torch.Tensor  # [S + 1] int32
    max_len: int
    n_seqs: int
    fields: dict[str, torch.Tensor]


# Token counts of buckets: 2^(k/4) x 1024 rounded up to 512, so padding costs at most ~19% of a
# micro-batch (~9% on average) and a run meets a handful of buckets.
_LADDER_STEP = 2**0.25


def bucket_for(n_tokens: int, n_seqs: int, longest: int) -> Bucket:
    """The bucket a micro-batch of ``n_tokens`` tokens in ``n_seqs`` sequences (the longest
    ``longest``) is padded to: tokens up to the next of 1024 x 2^k x {1, 1.25, 1.5, 1.75} (at
    most a quarter of padding, ~11% on average, and a run meets a handful of buckets), the
    longest up to a power of two (>= 16), the sequences with the padding ones up to a power of
    two (>= 8)."""
    if n_tokens <= 0 or n_seqs <= 0 or longest <= 0:
        raise ValueError(
            f"a bucket needs tokens, sequences and a longest sequence > 0, got {n_tokens}, "
            f"{n_seqs}, {longest}"
        )
    tokens = 1024
    while tokens < n_tokens:
        tokens += (1 << (tokens.bit_length() - 1)) // 4
    max_len = 1 << max(4, (longest - 1).bit_length())
    pad_seqs = math.ceil((tokens - n_tokens) / max_len)
    seqs = 1 << max(3, (n_seqs + pad_seqs - 1).bit_length())
    return Bucket(tokens, seqs, max_len)


def host_layout(
    lengths: Sequence[int], rows: Sequence[int], width: int, bucket: Bucket | None
) -> tuple[torch.Tensor, int, int, int, int]:
    """The packed row's layout as one int64 host tensor [index | position | seq id | cu], each of
    the first three T long (``index``: the flat position in the [B, width] batch of each packed
    token; padding points at 0), ``cu`` S + 1 long; returns it with T, S, the max length and the
    real (unpadded) token count."""
    lens = torch.tensor([int(lengths[i]) for i in rows], dtype=torch.int64)
    n_real, n = int(lens.sum()), len(rows)
    longest = int(lens.max())
    if bucket is not None:
        if bucket.tokens < n_real or bucket.max_len < longest:
            raise ValueError(f"{bucket} is too small for {n_real} tokens, the longest {longest}")
        pad = bucket.tokens - n_real
        pad_lens = [bucket.max_len] * (pad // bucket.max_len) + [pad % bucket.max_len] * bool(
            pad % bucket.max_len
        )
        if n + len(pad_lens) > bucket.seqs:
            raise ValueError(f"{bucket} has room for {bucket.seqs} sequences, not {n}+{pad}")
        all_lens = torch.cat([lens, torch.tensor(pad_lens, dtype=torch.int64)])
        total, n_seqs, max_len = bucket.tokens, bucket.seqs, bucket.max_len
    else:
        all_lens, total, n_seqs, max_len = lens, n_real, n, longest
    seq = torch.repeat_interleave(torch.arange(len(all_lens)), all_lens)
    ends = torch.cumsum(all_lens, 0)
    pos = torch.arange(total) - (ends - all_lens)[seq]
    starts = torch.tensor(list(rows), dtype=torch.int64) * width
    index = torch.zeros(total, dtype=torch.int64)
    index[:n_real] = starts[seq[:n_real]] + pos[:n_real]
    cu = torch.full((n_seqs + 1,), total, dtype=torch.int64)
    cu[0] = 0
    cu[1 : len(all_lens) + 1] = ends
    return torch.cat([index, pos, seq, cu]), total, n_seqs, max_len, n_real


def pack_micro_batch(
    batch: Mapping[str, torch.Tensor],
    rows: Sequence[int],
    lengths: Sequence[int],
    fields: Sequence[str],
    bucket: Bucket | None = None,
    out: PackedMicroBatch | None = None,
) -> PackedMicroBatch:
    """``rows`` of the device ``batch`` ([B, L] fields, ``input_ids`` among them) as one packed
    row, padded to ``bucket`` if given; written into ``out`` (a row of the same bucket, whose
    tensors stay where they are) if given, else into new tensors."""
    ids_2d = batch["input_ids"]
    device, width = ids_2d.device, ids_2d.shape[1]
    layout, total, n_seqs, max_len, n_real = host_layout(lengths, rows, width, bucket)
    if device.type == "cuda":
        layout = layout.pin_memory()  # the caching host allocator: no allocation per call
    layout = layout.to(device, non_blocking=True)
    index, pos, seq, cu = layout.split([total, total, total, n_seqs + 1])
    if out is None:
        out = PackedMicroBatch(
            input_ids=torch.empty(1, total, dtype=ids_2d.dtype, device=device),
            position_ids=torch.empty(1, total, dtype=torch.int64, device=device),
            seq_ids=torch.empty(1, total, dtype=torch.int64, device=device),
            cu_seqlens=torch.empty(n_seqs + 1, dtype=torch.int32, device=device),
            max_len=max_len,
            n_seqs=n_seqs,
            fields={k: torch.empty(1, total, dtype=batch[k].dtype, device=device) for k in fields},
        )
    elif out.input_ids.shape[1] != total or out.n_seqs != n_seqs or out.max_len != max_len:
        raise ValueError("the packed row to write into has another bucket's sizes")
    torch.index_select(ids_2d.reshape(-1), 0, index, out=out.input_ids.view(-1))
    out.position_ids.copy_(pos.view(1, -1))
    out.seq_ids.copy_(seq.view(1, -1))
    out.cu_seqlens.copy_(cu)
    for k in fields:
        torch.index_select(batch[k].reshape(-1), 0, index, out=out.fields[k].view(-1))
    if total > n_real:  # padding is never trained on, whatever its gathered values are
        out.fields["loss_mask"][:, n_real:] = False
    return out
