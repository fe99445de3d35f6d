"""Token-balanced dispatch of shards over data-parallel ranks.

Shards are prompt groups and stay whole. ``split_balanced`` places them largest first on the
least-loaded rank (LPT), then improves the result with moves and swaps between the heaviest rank
and the others while that lowers the sum of squared loads (so it always terminates). Everything
is deterministic: ties break by index and by rank number.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

from arl.protocol.rtensor import RTensor


def split_balanced(n_tokens: Sequence[int], n_ranks: int) -> list[list[int]]:
    """Indices of ``n_tokens`` per rank, balancing token sums; each list is in ascending order."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    sizes = [int(n) for n in n_tokens]
    bad = [(i, n) for i, n in enumerate(sizes) if n < 0]
    if bad:
        raise ValueError(f"token counts must be >= 0; index {bad[0][0]} has {bad[0][1]}")

    # LPT: largest first onto the least-loaded rank.
    heap = [(0, r) for r in range(n_ranks)]
    bins: list[list[int]] = [[] for _ in range(n_ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, r = heapq.heappop(heap)
        bins[r].append(i)
        heapq.heappush(heap, (load + sizes[i], r))

    _improve(sizes, bins)
    return [sorted(b) for b in bins]


def _improve(sizes: list[int], bins: list[list[int]], max_rounds: int = 10_000) -> None:
    """Move or swap items off the heaviest rank while that strictly lowers sum(load**2).

    A transfer of ``d`` tokens from a rank at load ``hi`` to one at ``lo`` lowers the sum of
    squares exactly when ``0 < d < hi - lo``; the best ``d`` is the one nearest ``(hi - lo) / 2``.
    """
    loads = [sum(sizes[i] for i in b) for b in bins]
    for _ in range(max_rounds):
        hi = max(range(len(bins)), key=lambda r: (loads[r], -r))
        best: tuple[float, int, int, int | None] | None = None  # (miss, rank, item, swapped item)
        for lo in sorted(range(len(bins)), key=lambda r: (loads[r], r)):
            gap = loads[hi] - loads[lo]
            if gap <= 1:
                break
            other = sorted((sizes[j], j) for j in bins[lo])
            other_sizes = [s for s, _ in other]
            for i in bins[hi]:
                # Moving i alone transfers sizes[i]; swapping with j transfers sizes[i] - sizes[j].
                candidates = [(sizes[i], None)]
                k = bisect.bisect_left(other_sizes, sizes[i] - gap / 2)
                for kk in (k - 1, k):
                    if 0 <= kk < len(other):
                        candidates.append((sizes[i] - other[kk][0], other[kk][1]))
                for d, j in candidates:
                    if 0 < d < gap:
                        miss = abs(d - gap / 2)
                        if best is None or miss < best[0]:
                            best = (miss, lo, i, j)
            if best is not None:
                break
        if best is None:
            return
        _, lo, i, j = best
        bins[hi].remove(i)
        bins[lo].append(i)
        loads[hi] -= sizes[i]
        loads[lo] += sizes[i]
        if j is not None:
            bins[lo].remove(j)
            bins[hi].append(j)
            loads[lo] -= sizes[j]
            loads[hi] += sizes[j]


def dispatch(batch: RTensor, n_ranks: int) -> tuple[list[RTensor], list[list[int]]]:
    """Split ``batch`` over ``n_ranks`` by token count: per-rank RTensors and the assignment."""
    assignment = split_balanced([r.n_tokens for r in batch.refs], n_ranks)
    return [batch.select(idx) for idx in assignment], assignment
