"""Rewards through the math-verify worker pool: right, wrong, malformed, hanging, off-thread."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from arl.rewards import verify_pool as vp
from arl.rewards.arith import arith_reward
from arl.rewards.gsm8k import gsm8k_reward
from arl.rewards.verify_pool import VerifyPool, VerifyPoolClosed, VerifyWorkerError
from tests.support.verify_scorers import EXIT_GOLD, MISBEHAVING, RAISE_GOLD, SLEEP_GOLD

pytestmark = pytest.mark.timeout(180)

ROW = {"question": "How many?", "answer": "48 / 2 = 24\n24 + 48 = 72\n#### 1,072"}


@pytest.fixture(scope="module")
def hook_pool():
    """A one-worker pool whose scorer hangs, raises or exits on the special golds."""
    pool = VerifyPool(n_workers=1, scorer=MISBEHAVING)
    try:
        yield pool
    finally:
        pool.close()


def test_gsm8k_reward_right_and_wrong():
    async def main() -> list[float]:
        return await asyncio.gather(
            gsm8k_reward("48/2 = 24, then 24 + 1048 = 1072. \\boxed{1072}", ROW),
            gsm8k_reward("So the answer is \\boxed{1,072}.", ROW),
            gsm8k_reward("The total is 1072", ROW),  # no box: expression extraction
            gsm8k_reward("I think 1072 is too big, so \\boxed{72}", ROW),  # the box wins
            gsm8k_reward("\\boxed{1071}", ROW),
        )

    assert asyncio.run(main()) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_malformed_completions_give_zero_without_errors():
    before = vp.default_pool().stats
    completions = ["", "\\boxed{", "((((((", "🙂" * 50, "\\frac{1}{" * 200, "x" * 20000]

    async def main() -> list[float]:
        return await asyncio.gather(*(gsm8k_reward(c, ROW) for c in completions))

    assert asyncio.run(main()) == [0.0] * len(completions)
    after = vp.default_pool().stats
    assert after.calls - before.calls == len(completions)
    assert after.timeouts == before.timeouts


def test_arith_reward():
    row = {"question": "What is 47 * 6?", "answer": "282"}

    async def main() -> tuple[float, float]:
        return (
            await arith_reward("47 * 6 = 282, so \\boxed{282}", row),
            await arith_reward("\\boxed{283}", row),
        )

    assert asyncio.run(main()) == (1.0, 0.0)


def test_bad_gold_is_an_error_scored_zero():
    pool = vp.default_pool()
    before = pool.stats.errors
    assert pool.verify_sync("no number here ((", "\\boxed{1}") == 0.0
    assert pool.stats.errors == before + 1
    with pytest.raises(Exception, match="no '#### <number>'"):
        asyncio.run(gsm8k_reward("\\boxed{1}", {"answer": "72"}))


def test_reward_from_a_non_main_thread():
    results: list[float] = []

    def in_thread() -> None:
        results.append(asyncio.run(gsm8k_reward("\\boxed{1072}", ROW)))
        results.append(vp.default_pool().verify_sync("5", "\\boxed{5}"))

    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    assert results == [1.0, 1.0]


def test_hanging_check_times_out_and_the_worker_is_replaced(hook_pool):
    before = hook_pool.stats
    assert hook_pool.verify_sync("1", "1") == 1.0
    pids_before = hook_pool.worker_pids()
    assert asyncio.run(hook_pool.verify(SLEEP_GOLD, "1", timeout=1.0)) == 0.0
    after = hook_pool.stats
    assert after.timeouts == before.timeouts + 1
    assert after.restarts == before.restarts + 1
    assert len(hook_pool.worker_pids()) == 1 and hook_pool.worker_pids() != pids_before
    _wait_gone(pids_before[0])
    # The replacement serves the next call, from a fresh event loop.
    assert asyncio.run(hook_pool.verify("3", "\\boxed{3}")) == 1.0


def test_worker_error_and_crash_give_zero_and_are_counted(hook_pool):
    before = hook_pool.stats
    assert hook_pool.verify_sync(RAISE_GOLD, "1") == 0.0
    assert hook_pool.verify_sync(EXIT_GOLD, "1") == 0.0
    after = hook_pool.stats
    assert after.errors == before.errors + 2
    assert after.restarts == before.restarts + 1  # only the crash needed a new worker
    assert hook_pool.verify_sync("2", "\\boxed{2}") == 1.0


def test_the_default_scorer_has_no_special_golds():
    pool = vp.default_pool()
    before = pool.stats
    assert pool.verify_sync(SLEEP_GOLD, "1", timeout=30.0) == 0.0  # a gold that fails
    assert pool.stats.timeouts == before.timeouts


def test_a_scorer_that_does_not_import_is_a_clear_error():
    with pytest.raises(ValueError, match="'module:function'"):
        VerifyPool(scorer="no_colon_here")
    pool = VerifyPool(n_workers=1, scorer="tests.support.no_such_module:score")
    try:
        with pytest.raises(VerifyWorkerError, match="tests.support.no_such_module:score"):
            pool.verify_sync("1", "1")
    finally:
        pool.close()


def test_close_ends_workers_and_refuses_calls():
    async def main() -> list[int]:
        async with VerifyPool(n_workers=2) as pool:
            assert await asyncio.gather(pool.verify("1", "1"), pool.verify("2", "2")) == [1.0, 1.0]
            pids = pool.worker_pids()
        assert pool.worker_pids() == []
        with pytest.raises(VerifyPoolClosed):
            await pool.verify("1", "1")
        with pytest.raises(VerifyPoolClosed):
            pool.verify_sync("1", "1")
        return pids

    pids = asyncio.run(main())
    assert len(pids) == 2
    for pid in pids:  # close() reaped them: no such process any more
        assert not Path(f"/proc/{pid}").exists()


def test_start_spawns_the_workers_before_the_first_call_and_they_serve_it():
    pool = VerifyPool(n_workers=2)
    try:
        assert pool.worker_pids() == []  # lazy without start
        pool.start()
        pids = pool.worker_pids()
        assert len(pids) == 2
        pool.start()  # idempotent: running workers are kept
        assert pool.worker_pids() == pids
        assert pool.verify_sync("6", "\\boxed{6}") == 1.0
        assert pool.worker_pids() == pids and pool.stats.restarts == 0
    finally:
        pool.close()
    with pytest.raises(VerifyPoolClosed):
        pool.start()


def test_arl_rewards_start_the_default_pool_in_their_warm_up():
    for reward in (arith_reward, gsm8k_reward):
        assert reward.warm_up is vp.start_default_pool
    vp.start_default_pool()
    assert len(vp.default_pool().worker_pids()) == vp.default_pool().n_workers


def test_workers_exit_when_the_parent_dies(tmp_path):
    """A parent that dies without closing the pool: its worker sees EOF and exits."""
    script = textwrap.dedent(
        """
        import os, sys
        from arl.rewards.verify_pool import VerifyPool
        pool = VerifyPool(n_workers=1)
        assert pool.verify_sync("1", "1") == 1.0
        print(pool.worker_pids()[0], flush=True)
        os._exit(0)  # no close(), no atexit
        """
    )
    root = str(Path(vp.__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    worker_pid = int(out.stdout.strip())
    _wait_gone(worker_pid)


def _wait_gone(pid: int) -> None:
    """Block until ``pid`` has exited (gone, or a zombie awaiting its new parent's reaping)."""
    import time

    for _ in range(600):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1].split()[0]
        except (FileNotFoundError, IndexError):
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.1)
    raise AssertionError(f"worker pid {pid} still running 60 s after its parent died")
