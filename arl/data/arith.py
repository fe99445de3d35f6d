"""Generated two-digit x one-digit multiplication ("What is a * b?"), answer in ``\\boxed{}``.

``a`` is in 10..99, ``b`` in 2..9: 720 pairs, split once and for all (independent of the
sampling seed) into 576 train and 144 test pairs, so no test question is ever trained on.
"""

from __future__ import annotations

import random
from typing import Any

ARITH_PROMPT_SUFFIX = "Put your final answer within \\boxed{}."
_SPLIT_SEED = 20240611  # fixes the train/test partition of pairs; never derived from `seed`
_TEST_FRACTION = 0.2


def _pairs(split: str) -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(10, 100) for b in range(2, 10)]
    random.Random(_SPLIT_SEED).shuffle(pairs)
    n_test = int(len(pairs) * _TEST_FRACTION)
    if split == "test":
        return pairs[:n_test]
    if split == "train":
        return pairs[n_test:]
    raise ValueError(f"split={split!r}: use 'train' or 'test'")


def build_arith_messages(question: str) -> list[dict[str, str]]:
    """Chat messages asking the question with the final answer in ``\\boxed{}``."""
    return [{"role": "user", "content": f"{question} {ARITH_PROMPT_SUFFIX}"}]


def make_arith(n: int, seed: int, split: str) -> list[dict[str, Any]]:
    """``n`` rows ``{"question": "What is a * b?", "answer": str(a * b), "messages": ...}``.

    Pairs come from ``split``'s fixed pair set, without repeats until every pair was used once.
    """
    if n < 1:
        raise ValueError(f"n={n}: ask for at least one row")
    pool = _pairs(split)
    rng = random.Random(seed)
    chosen: list[tuple[int, int]] = []
    while len(chosen) < n:
        batch = pool[:]
        rng.shuffle(batch)
        chosen.extend(batch[: n - len(chosen)])
    rows = []
    for a, b in chosen:
        question = f"What is {a} * {b}?"
        rows.append(
            {"question": question, "answer": str(a * b), "messages": build_arith_messages(question)}
        )
    return rows


def load_arith(
    path: str, split: str, on_bad_row: str = "skip"
) -> tuple[list[dict[str, Any]], dict]:
    """The `data.loader` entry for arith: every pair of ``split`` once, shuffled.

    ``path`` is ignored (the data is generated); the second value mirrors other loaders' stats.
    """
    rows = make_arith(len(_pairs(split)), seed=0, split=split)
    return rows, {"source": "arith", "kept": len(rows), "skipped": 0}
