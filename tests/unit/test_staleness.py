"""StalenessSemaphore: the DESIGN §5 formula, wake-ups, restore, and randomized simulations."""

from __future__ import annotations

import asyncio
import random

import pytest

from arl.control.staleness import StalenessError, StalenessSemaphore, is_stale


async def _spin(n: int = 5) -> None:
    """Let other tasks run; a blocked acquire stays blocked however often we yield."""
    for _ in range(n):
        await asyncio.sleep(0)


@pytest.mark.parametrize(
    ("batch", "eta", "max_conc", "version", "accepted", "running", "expected"),
    [
        (4, 0, 100, 0, 0, 0, 4),  # (0 + 0 + 1) * 4
        (4, 2, 100, 0, 0, 0, 12),  # (2 + 0 + 1) * 4
        (4, 2, 5, 0, 0, 0, 5),  # concurrency binds
        (4, 1, 100, 3, 10, 2, 8),  # (1 + 3 + 1) * 4 - 12
        (4, 0, 100, 1, 8, 0, 0),  # a full batch of version 1 already accepted
        (2, 1, 3, 0, 1, 3, 0),  # concurrency exhausted
    ],
)
def test_capacity_formula(batch, eta, max_conc, version, accepted, running, expected):
    sem = StalenessSemaphore(batch, eta, max_conc)
    sem.set_version(version)
    sem.load_state_dict({"accepted": accepted, "version": version, "batch_size": batch})
    sem._running = running  # the counters of a state a simulation would reach
    assert sem.capacity() == expected


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size=0"):
        StalenessSemaphore(0, 1, 4)
    with pytest.raises(ValueError, match="max_staleness=-1"):
        StalenessSemaphore(4, -1, 4)
    with pytest.raises(ValueError, match="max_concurrent=0"):
        StalenessSemaphore(4, 1, 0)


def test_accepted_release_does_not_free_a_staleness_slot_but_a_rejected_one_does():
    async def main() -> None:
        sem = StalenessSemaphore(batch_size=2, max_staleness=0, max_concurrent=100)
        await sem.acquire()
        await sem.acquire()
        third = asyncio.create_task(sem.acquire())
        await _spin()
        assert not third.done()
        sem.release(accepted=True)  # accepted + running unchanged: still no capacity
        await _spin()
        assert not third.done()
        sem.release(accepted=False)  # a rejected group frees its slot
        await _spin()
        assert third.done()
        assert (sem.running, sem.accepted) == (1, 1)

    asyncio.run(main())


def test_a_forgotten_accepted_group_gives_its_place_back():
    async def main() -> None:
        sem = StalenessSemaphore(batch_size=1, max_staleness=0, max_concurrent=100)
        await sem.acquire()
        sem.release(accepted=True)
        nxt = asyncio.create_task(sem.acquire())
        await _spin()
        assert not nxt.done()  # the budget of version 0 is spent
        sem.forget()  # that group was dropped as too stale: a replacement may start
        await _spin()
        assert nxt.done() and (sem.running, sem.accepted) == (1, 0)
        with pytest.raises(StalenessError, match="no accepted group"):
            sem.forget()

    asyncio.run(main())


def test_accepted_release_frees_a_concurrency_slot():
    async def main() -> None:
        sem = StalenessSemaphore(batch_size=10, max_staleness=0, max_concurrent=1)
        await sem.acquire()
        second = asyncio.create_task(sem.acquire())
        await _spin()
        assert not second.done()
        sem.release(accepted=True)
        await _spin()
        assert second.done() and sem.running == 1 and sem.accepted == 1

    asyncio.run(main())


def test_set_version_wakes_all_waiters_it_makes_room_for():
    async def main() -> None:
        sem = StalenessSemaphore(batch_size=2, max_staleness=0, max_concurrent=100)
        for _ in range(2):
            await sem.acquire()
            sem.release(accepted=True)
        waiters = [asyncio.create_task(sem.acquire()) for _ in range(3)]
        await _spin()
        assert not any(w.done() for w in waiters)
        sem.set_version(1)  # budget 4 - 2 accepted: room for exactly two
        await _spin()
        assert sum(w.done() for w in waiters) == 2
        assert sem.capacity() == 0
        sem.set_version(2)
        await _spin()
        assert all(w.done() for w in waiters)

    asyncio.run(main())


def test_cancelled_waiter_takes_no_slot():
    async def main() -> None:
        sem = StalenessSemaphore(batch_size=1, max_staleness=0, max_concurrent=10)
        await sem.acquire()
        waiter = asyncio.create_task(sem.acquire())
        await _spin()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert sem.running == 1 and sem._waiters == []
        sem.release(accepted=False)
        assert sem.capacity() == 1

    asyncio.run(main())


def test_misuse_raises_typed_errors():
    sem = StalenessSemaphore(batch_size=2, max_staleness=1, max_concurrent=4)
    with pytest.raises(StalenessError, match="without a matching acquire"):
        sem.release(accepted=True)
    sem.set_version(3)
    with pytest.raises(StalenessError, match="from 3 to 2"):
        sem.set_version(2)
    with pytest.raises(StalenessError, match="batch_size=3"):
        sem.load_state_dict({"accepted": 0, "version": 0, "batch_size": 3})

    async def load_while_running() -> None:
        await sem.acquire()
        with pytest.raises(StalenessError, match="1 rollouts running"):
            sem.load_state_dict(sem.state_dict())

    asyncio.run(load_while_running())


def test_injected_version_source():
    async def main() -> None:
        trainer_version = {"v": 0}
        sem = StalenessSemaphore(1, 0, 10, version_source=lambda: trainer_version["v"])
        await sem.acquire()
        sem.release(accepted=True)
        waiter = asyncio.create_task(sem.acquire())
        await _spin()
        assert not waiter.done()
        with pytest.raises(StalenessError, match="injected source"):
            sem.set_version(1)
        trainer_version["v"] = 1
        assert sem.version == 1
        sem.version_changed()
        await _spin()
        assert waiter.done()

    asyncio.run(main())


def test_is_stale():
    assert not is_stale(5, 5, 0)
    assert is_stale(4, 5, 0)
    assert not is_stale(3, 5, 2)
    assert is_stale(2, 5, 2)
    with pytest.raises(ValueError, match="prompt tokens carry version -1"):
        is_stale(-1, 5, 2)
    with pytest.raises(ValueError, match="newer than the current version"):
        is_stale(6, 5, 2)


class _Sim:
    """Rollouts with random durations and rejections, a trainer taking batches oldest first.

    Every group records the version it started under (its oldest token version). The trainer
    bumps the version after each batch, at random moments, and drops stale groups with
    `is_stale`. Pure asyncio scheduling: deterministic for a seed, no wall-clock time.
    """

    def __init__(self, sem: StalenessSemaphore, seed: int, in_order: bool, reject_p: float):
        self.sem, self.rng = sem, random.Random(seed)
        self.in_order, self.reject_p = in_order, reject_p
        self.buffer: list[int] = []  # start versions of accepted groups, in acceptance order
        self.trained: list[tuple[int, int]] = []  # (train version, start version) kept
        self.dropped = 0
        self.started = 0
        self.max_started_over_budget = -(10**9)
        self.min_capacity = 10**9
        self.batch_ready = asyncio.Event()
        self._last_done: asyncio.Event | None = None

    def _check(self) -> None:
        sem = self.sem
        self.min_capacity = min(self.min_capacity, sem.capacity())
        budget = (sem.max_staleness + sem.version + 1) * sem.batch_size
        self.max_started_over_budget = max(
            self.max_started_over_budget, sem.accepted + sem.running - budget
        )
        assert sem.running <= sem.max_concurrent

    async def _rollout(self, start_version: int, prev: asyncio.Event | None, done: asyncio.Event):
        await _spin(self.rng.randint(0, 30))
        if self.in_order and prev is not None:
            await prev.wait()  # finish in start order
        accepted = self.rng.random() >= self.reject_p
        if accepted:
            self.buffer.append(start_version)
        self.sem.release(accepted)
        done.set()
        self._check()
        if len(self.buffer) >= self.sem.batch_size:
            self.batch_ready.set()

    async def _producer(self, tasks: set[asyncio.Task]) -> None:
        while True:
            await self.sem.acquire()
            self.started += 1
            self._check()
            done = asyncio.Event()
            task = asyncio.create_task(self._rollout(self.sem.version, self._last_done, done))
            self._last_done = done
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _trainer(self, steps: int) -> None:
        for _ in range(steps):
            while len(self.buffer) < self.sem.batch_size:
                self.batch_ready.clear()
                await self.batch_ready.wait()
            batch = self.buffer[: self.sem.batch_size]
            del self.buffer[: self.sem.batch_size]
            version = self.sem.version
            for start in batch:
                if is_stale(start, version, self.sem.max_staleness):
                    self.dropped += 1
                else:
                    self.trained.append((version, start))
            await _spin(self.rng.randint(0, 40))  # training takes a while
            self.sem.set_version(version + 1)
            self._check()

    async def run(self, steps: int) -> None:
        tasks: set[asyncio.Task] = set()
        producer = asyncio.create_task(self._producer(tasks))
        try:
            await self._trainer(steps)
        finally:
            producer.cancel()
            for t in list(tasks):
                t.cancel()
            await asyncio.gather(producer, *tasks, return_exceptions=True)


@pytest.mark.parametrize("seed", range(12))
def test_simulation_random_finish_order(seed):
    rng = random.Random(seed)
    batch, eta, conc = rng.randint(1, 6), rng.randint(0, 3), rng.randint(1, 20)
    sim = _Sim(StalenessSemaphore(batch, eta, conc), seed, in_order=False, reject_p=0.2)
    asyncio.run(sim.run(steps=15))
    assert sim.min_capacity >= 0
    assert sim.max_started_over_budget <= 0
    assert sim.trained, "the trainer trained nothing"
    assert all(v - start <= eta for v, start in sim.trained)
    # Every started group is accounted for: trained, dropped, still buffered, rejected or running.
    assert len(sim.trained) + sim.dropped + len(sim.buffer) <= sim.started


@pytest.mark.parametrize("seed", range(12))
def test_simulation_in_order_needs_no_drops(seed):
    """Groups accepted in start order: the semaphore alone keeps every sample within eta."""
    rng = random.Random(1000 + seed)
    batch, eta, conc = rng.randint(1, 6), rng.randint(0, 3), rng.randint(1, 20)
    sim = _Sim(StalenessSemaphore(batch, eta, conc), seed, in_order=True, reject_p=0.2)
    asyncio.run(sim.run(steps=15))
    assert sim.dropped == 0
    assert len(sim.trained) == 15 * batch
    assert max(v - start for v, start in sim.trained) <= eta
    assert sim.min_capacity >= 0


@pytest.mark.parametrize("seed", range(8))
def test_eta_zero_is_synchronous(seed):
    """eta=0: every group of the batch trained at version v started at version v."""
    sim = _Sim(StalenessSemaphore(3, 0, 100), seed, in_order=False, reject_p=0.3)
    asyncio.run(sim.run(steps=10))
    assert sim.dropped == 0
    assert len(sim.trained) == 30
    assert all(v == start for v, start in sim.trained)


def test_restore_continues_without_burst():
    batch, eta, conc = 4, 1, 50
    first = _Sim(StalenessSemaphore(batch, eta, conc), seed=7, in_order=False, reject_p=0.1)
    asyncio.run(first.run(steps=6))
    state = first.sem.state_dict()
    assert state["version"] == 6
    assert state["accepted"] >= 6 * batch

    restored = StalenessSemaphore(batch, eta, conc)
    restored.load_state_dict(state)
    assert (restored.version, restored.accepted, restored.running) == (6, state["accepted"], 0)
    # Fresh counters at version 6 would allow (1 + 6 + 1) * 4 = 32 starts at once.
    assert restored.capacity() == (eta + 6 + 1) * batch - state["accepted"]
    assert restored.capacity() < (eta + 6 + 1) * batch

    second = _Sim(restored, seed=8, in_order=False, reject_p=0.1)
    # Groups accepted before the crash but not trained are lost with the node: the trainer
    # restarts with an empty buffer, and the restored counters must still let it progress.
    restored.load_state_dict({**state, "accepted": 6 * batch})
    asyncio.run(second.run(steps=4))
    assert restored.version == 10
    assert second.min_capacity >= 0 and second.max_started_over_budget <= 0
    assert all(v - start <= eta for v, start in second.trained)
