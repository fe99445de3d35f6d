"""How many training-graph buckets 40 gsm8k-like steps meet: FFD micro-batches (as main packs
them) against balanced ones (as many micro-batches, equal loads). CPU only, seconds.

    python3 docs/results/loop_h200/s30_bucket_sim.py

Lengths: 64 groups x 4 samples a step, prompts of 100-260 tokens, completions at the 1,024-token
cap 30% of the time, else 80-700 tokens (about the real run's ~170k tokens a step).
"""

import collections
import random

from arl.algo.packing import balanced_partition, ffd_bins, micro_batches
from arl.train.packed import bucket_for

BUDGET = 16384


def step_lengths(rng: random.Random) -> list[int]:
    out = []
    for _ in range(64):
        prompt = rng.randint(100, 260)
        for _ in range(4):
            out.append(prompt + (1024 if rng.random() < 0.3 else rng.randint(80, 700)))
    return out


def balanced(lengths: list[int], budget: int) -> list[list[int]]:
    parts = balanced_partition(lengths, len(ffd_bins(lengths, budget)))
    if all(sum(lengths[i] for i in p) <= budget for p in parts):
        return parts
    return ffd_bins(lengths, budget)


for name, split in (("ffd", micro_batches), ("balanced", balanced)):
    rng = random.Random(0)
    seen: collections.Counter = collections.Counter()
    padded = real = 0
    for _ in range(40):
        lengths = step_lengths(rng)
        for rows in split(lengths, BUDGET):
            mb = [lengths[i] for i in rows]
            b = bucket_for(sum(mb), len(mb), max(mb))
            seen[b] += 1
            padded += b.tokens
            real += sum(mb)
    print(f"{name}: {len(seen)} buckets, padding {padded / real - 1:.1%} of the tokens")
    for b, n in sorted(seen.items()):
        print(f"  {b}: {n} micro-batches")
