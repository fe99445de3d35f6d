"""Scorers for `VerifyPool` workers that misbehave on purpose: a check that hangs, raises, or
kills its worker. ``VerifyPool(scorer=MISBEHAVING)`` runs them; other golds score normally."""

from __future__ import annotations

import os
import time

from arl.rewards.verify_pool import math_verify_score

MISBEHAVING = "tests.support.verify_scorers:misbehaving_score"
SLEEP_GOLD = "__arl_test_sleep__"  # the worker hangs (a check that never ends)
RAISE_GOLD = "__arl_test_raise__"  # the check raises
EXIT_GOLD = "__arl_test_exit__"  # the worker dies mid-request


def misbehaving_score(gold: str, answer: str) -> float:
    """Hang, raise or exit for the three special golds; math-verify for any other."""
    if gold == SLEEP_GOLD:
        time.sleep(3600)
    if gold == RAISE_GOLD:
        raise RuntimeError("a check that raises")
    if gold == EXIT_GOLD:
        os._exit(3)
    return math_verify_score(gold, answer)
