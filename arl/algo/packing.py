"""Batching of trajectory shards: concatenation, mini-batch and micro-batch splits, packing.

A batch is a dict of tensors with rows right-padded to a common length L: ``input_ids`` int64,
``attention_mask``/``loss_mask`` bool, ``logprobs`` float32, ``versions`` int32 (all [B, L]),
``rewards`` float32 [B] and ``group_ids`` int64 [B] (the shard each row came from).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

# Fill values when a per-token field is padded: prompt/padding tokens carry version -1.
_PAD_VALUE = {"versions": -1}


def concat_shards(shards: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad the shards' [n, L] fields to the longest L and stack them to [B, L].

    [n] fields (``rewards``) are concatenated; ``group_ids`` [B] numbers the shards 0..S-1.
    """
    if not shards:
        raise ValueError("concat_shards needs at least one shard, got an empty list")
    keys = set(shards[0])
    for i, s in enumerate(shards):
        if set(s) != keys:
            raise ValueError(f"shard {i} has keys {sorted(s)}, shard 0 has {sorted(keys)}")
    max_len = max(int(s["input_ids"].shape[1]) for s in shards)
    out: dict[str, torch.Tensor] = {}
    for k in sorted(keys):
        parts = []
        for s in shards:
            t = s[k]
            if t.dim() >= 2 and t.shape[1] < max_len:
                fill = _PAD_VALUE.get(k, 0)
                pad = t.new_full((t.shape[0], max_len - t.shape[1], *t.shape[2:]), fill)
                t = torch.cat([t, pad], dim=1)
            parts.append(t)
        out[k] = torch.cat(parts, dim=0)
    out["group_ids"] = torch.cat(
        [torch.full((s["input_ids"].shape[0],), i, dtype=torch.int64) for i, s in enumerate(shards)]
    )
    return out


def seq_lengths(batch: Mapping[str, torch.Tensor]) -> list[int]:
    """Number of real (attended) tokens of each row."""
    return batch["attention_mask"].sum(dim=1).tolist()


def select_rows(batch: Mapping[str, torch.Tensor], rows: Sequence[int]) -> dict[str, torch.Tensor]:
    """The sub-batch of ``rows``, [B, L] fields trimmed to the longest selected row."""
    idx = torch.as_tensor(list(rows), dtype=torch.int64)
    width = int(batch["attention_mask"][idx].sum(dim=1).max()) if len(idx) else 0
    out = {}
    for k, t in batch.items():
        t = t[idx.to(t.device)]
        out[k] = t[:, :width] if t.dim() >= 2 else t
    return out


def ffd_bins(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit-decreasing: indices of ``lengths`` in bins whose length sums stay <= budget.

    Longest first (ties by index); each goes into the first bin with room. Bins keep their
    indices sorted. Raises ValueError for a sequence longer than the budget.
    """
    if budget <= 0:
        raise ValueError(f"max_tokens_per_mb must be positive, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        if n > budget:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than max_tokens_per_mb={budget}; raise "
                "max_tokens_per_mb to at least the longest prompt + completion, or shorten "
                "max_new_tokens / the prompt"
            )
        for b, load in enumerate(loads):
            if load + n <= budget:
                bins[b].append(i)
                loads[b] += n
                break
        else:
            bins.append([i])
            loads.append(n)
    return [sorted(b) for b in bins]


def agree_count(n: int, group: dist.ProcessGroup | None = None) -> int:
    """The maximum of ``n`` over all ranks (``n`` itself without torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return n
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def micro_batches(
    lengths: Sequence[int], budget: int, n_min: int = 1, *, balanced: bool = False
) -> list[list[int]]:
    """FFD bins of ``lengths`` under ``budget``, padded with empty bins to at least ``n_min``.

    Pass ``n_min = agree_count(len(ffd_bins(...)))`` so every rank runs the same number of
    forward/backward passes (FSDP collectives must stay in step). ``balanced``: as many bins,
    but of about equal loads (`balanced_partition`) instead of full ones and a remainder, where
    every bin stays under ``budget`` (else the FFD bins): the micro-batches of a step then share
    one size, so CUDA graphs of the padded sizes (`arl.train.packed.bucket_for`) meet a few
    buckets instead of one per remainder.
    """
    bins = ffd_bins(lengths, budget)
    if balanced and len(bins) > 1:
        even = balanced_partition(lengths, max(len(bins), n_min))
        if all(sum(lengths[i] for i in part) <= budget for part in even):
            return even
    return bins + [[] for _ in range(n_min - len(bins))]


def balanced_partition(lengths: Sequence[int], n_parts: int) -> list[list[int]]:
    """Split indices into ``n_parts`` groups of similar total length (longest first, to the
    lightest part); parts keep their indices sorted and may be empty when rows are few."""
    if n_parts <= 0:
        raise ValueError(f"number of parts must be positive, got {n_parts}")
    parts: list[list[int]] = [[] for _ in range(n_parts)]
    loads = [0] * n_parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        p = min(range(n_parts), key=lambda p: (loads[p], p))
        parts[p].append(i)
        loads[p] += lengths[i]
    return [sorted(p) for p in parts]


class PackedRow(NamedTuple):
    """Sequences concatenated into one row; sequence j spans cu_seqlens[j]:cu_seqlens[j+1]."""

    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T], restarting at 0 for each sequence
    cu_seqlens: torch.Tensor  # [n + 1] int64
    index: torch.Tensor  # [T] int64: where each packed token sits in the flattened [n, L] rows


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: Sequence[int] | None = None
) -> PackedRow:
    """Concatenate the attended tokens of each right-padded row into a single row.

    position_ids restart at 0 per sequence; transformers' attention builds a block-diagonal
    causal mask from that when called with ``attention_mask=None``. ``lengths`` (each row's
    attended tokens, known on the host) lets a GPU batch be packed without a host sync: the
    packed size need not be read back from the device.
    """
    n, width = attention_mask.shape
    dev = input_ids.device
    flat = attention_mask.reshape(-1).bool()
    if lengths is None:
        index = flat.nonzero().squeeze(1)
        cu = torch.zeros(n + 1, dtype=torch.int64, device=dev)
        cu[1:] = torch.cumsum(attention_mask.sum(dim=1), 0)
    else:
        total = int(sum(lengths))
        index = torch.nonzero_static(flat, size=total).squeeze(1)
        bounds = [0, *itertools.accumulate(int(k) for k in lengths)]
        cu = torch.tensor(bounds, dtype=torch.int64).to(dev, non_blocking=True)
    ids = input_ids.reshape(-1)[index]
    pos = index % width
    return PackedRow(ids[None], pos[None], cu, index)


def unpack_values(
    values: torch.Tensor, attention_mask: torch.Tensor, index: torch.Tensor | None = None
) -> torch.Tensor:
    """Scatter per-token ``values`` [T] (or [1, T]) of a packed row back to [n, L], 0 on padding.

    ``index`` is the packed row's `PackedRow.index`; with it nothing is read back to the host.
    """
    if index is None:
        index = attention_mask.reshape(-1).bool().nonzero().squeeze(1)
    out = values.new_zeros(attention_mask.numel())
    return out.index_copy(0, index, values.reshape(-1)).view(attention_mask.shape)
