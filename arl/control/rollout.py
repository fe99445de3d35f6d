"""`RolloutController`: keeps the rollout nodes busy, within the staleness bound (DESIGN §4.1, §5).

A submit loop acquires a slot from the `StalenessSemaphore`, takes the next prompt from the
loader and sends it to the rollout node with the fewest groups in flight. A finished group stays
on its node as a shard; the controller keeps only its `ShardRef` and metadata. The trainer takes
accepted groups with `prepare_batch`, by ``order``: ``finished`` (the default) in the order they
finished, except where the groups due within eta (trained by their submission version + eta)
would not fit in the batches left before they are due: then the batch takes, and waits for,
those first. So a batch waits behind a long generation only where the bound needs it, not while
later groups are done and hold the staleness budget the engines need. ``submitted`` takes them
in the loader's order, so a run's batches do not depend on timing. Failed and rejected groups
are skipped, and groups too stale for the current version are dropped or kept by
``stale_policy``. A checkpoint (`state_dict`) records the first group not taken and the later
ones already taken, so a resumed run generates every other group again and never trains one
twice.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs

from arl.control.controller import BadReply, NodeLost, RemoteObject
from arl.control.staleness import StalenessSemaphore, is_stale
from arl.data.loader import StatefulLoader
from arl.protocol.errors import ErrorKind, RemoteError
from arl.protocol.remote import RolloutWorkerAPI, rollout_worker
from arl.protocol.report import GroupReport, RejectedGroup, ReportError, report_from_wire
from arl.protocol.rtensor import RTensor, ShardRef
from arl.stats.trace import Tracer

log = logging.getLogger("arl.rollout")
_CANCEL_CHUNK = 256  # groups `RolloutController.stop` cancels in one turn of the loop


class RolloutFailed(RuntimeError):
    """Rollout cannot go on (a node was lost, or every recent group failed)."""


@attrs.define
class Finished:
    """One accepted prompt group: where its shard is and what the node reported."""

    ref: ShardRef
    info: GroupReport
    submitted_version: int


@attrs.define
class RolloutStats:
    """Counters since the start of the run (or of the last `pop_stats`)."""

    submitted: int = 0
    accepted: int = 0
    failed: int = 0
    rejected: int = 0  # groups rejected by the filter (`accept`) or by the workflow
    rejected_samples: int = 0  # episodes a workflow dropped from their group (agent errors)
    stale_dropped: int = 0
    stale_kept: int = 0
    timed_out: int = 0  # abandoned after rollout.group_timeout (also counted in failed)
    bad_replies: int = 0  # run_group results of the wrong shape (they stop the run)


BATCH_ORDERS = ("finished", "submitted")


class RolloutController:
    """Submits prompt groups to rollout workers while the staleness semaphore allows."""

    def __init__(
        self,
        workers: list[RemoteObject],
        loader: StatefulLoader,
        semaphore: StalenessSemaphore,
        *,
        peers: dict[str, str],
        free: Callable[[list[ShardRef]], Any],
        stale_policy: str = "keep",
        accept: Callable[[GroupReport], bool] | None = None,
        max_consecutive_failures: int = 16,
        max_consecutive_rejections: int = 256,
        stall_log_s: float | None = 60.0,
        order: str = "finished",
    ):
        if not workers:
            raise ValueError("a RolloutController needs at least one rollout worker")
        if order not in BATCH_ORDERS:
            raise ValueError(f"order={order!r}: a batch is taken in one of {BATCH_ORDERS}")
        self.order = order
        self.workers = [rollout_worker(w) for w in workers]
        self.loader, self.sem = loader, semaphore
        self.peers, self.free = peers, free
        self.stale_policy, self.accept = stale_policy, accept
        self.max_consecutive_failures = max_consecutive_failures
        self.max_consecutive_rejections = max_consecutive_rejections
        self.stats = RolloutStats()
        self._inflight = {id(w): 0 for w in self.workers}
        self._held: set[int] = set()  # workers paused in place by `held`
        self._asleep: set[int] = set()  # held workers whose engine sleeps (`held(sleep=True)`)
        self.sleep_freed_bytes = 0  # what the engines' last sleep freed, summed
        # Submission index -> finished group, or None for a failed/rejected one; a dict keeps
        # insertion order, which is the order the groups finished in.
        self._done: dict[int, Finished | None] = {}
        self._loader_states: dict[int, dict] = {}  # loader position before each submission
        self._next_take = 0  # the first index not taken (nor skipped)
        self._taken_after: set[int] = set()  # indices above _next_take taken or skipped
        self._skip: set[int] = set()  # indices a restored run must not submit (taken before)
        self._accepted_taken = 0  # accepted groups taken
        self._sub_version: dict[int, int] = {}  # policy version at submission, until taken
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._failed_event = asyncio.Event()
        self._consecutive_failures = 0
        self._consecutive_rejections = 0
        self._next_index = 0
        self.run_tag = "g"
        self.stall_log_s = stall_log_s
        self._running: dict[str, tuple[str, float]] = {}  # key -> (node, submitted at)
        self._last_finish = time.monotonic()
        self._stall_task: asyncio.Task | None = None
        self.tracer = Tracer(None)  # the trainer hands over its own

    # ---- lifetime ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start submitting (idempotent)."""
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._submit_loop(), name="arl-rollout-submit")
            self._loop_task.add_done_callback(self._submit_loop_ended)
        if self._stall_task is None and self.stall_log_s:
            self._last_finish = time.monotonic()
            self._stall_task = asyncio.create_task(self._stall_watch(), name="arl-rollout-stall")

    async def stop(self) -> None:
        """Stop submitting and cancel the groups in flight."""
        tasks = [t for t in [self._loop_task, self._stall_task, *self._tasks] if t is not None]
        # A cancelled task unwinds in the loop's next turn: cancelled all at once, 200k groups
        # in flight were one turn of 13 s, long enough for the train nodes to leave as if the
        # controller were lost, and with them the checkpoint a SIGTERM stops to write.
        for i in range(0, len(tasks), _CANCEL_CHUNK):
            for t in tasks[i : i + _CANCEL_CHUNK]:
                t.cancel()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loop_task = self._stall_task = None

    async def _stall_watch(self) -> None:
        """Log the groups in flight when none has finished for ``stall_log_s`` (a reward or a
        tool that never returns would otherwise show only a progress bar that does not move)."""
        assert self.stall_log_s
        logged = 0.0
        while True:
            await asyncio.sleep(min(self.stall_log_s / 4, 5.0))
            now = time.monotonic()
            if self._held and len(self._held) == len(self.workers):
                # Every engine is held for a train phase (asleep, under gpu_sharing=sleep): no
                # group can finish, by design. Quiet counts again from the release.
                self._last_finish = now
                continue
            quiet = now - self._last_finish
            if not self._running or quiet < self.stall_log_s or now - logged < self.stall_log_s:
                continue
            logged = now
            oldest = sorted(self._running.items(), key=lambda kv: kv[1][1])
            shown = ", ".join(f"{k} on {n} for {now - t:.0f}s" for k, (n, t) in oldest[:8])
            more = f" and {len(oldest) - 8} more" if len(oldest) > 8 else ""
            log.warning(
                "no prompt group finished for %.0fs (rollout.stall_log_s=%g); %d in flight: %s%s",
                quiet,
                self.stall_log_s,
                len(oldest),
                shown,
                more,
            )

    def _submit_loop_ended(self, task: asyncio.Task) -> None:
        # An error in the loop itself (the loader, a bug) must stop rollout with that error:
        # prepare_batch would otherwise wait for groups that are never submitted.
        if not task.cancelled() and task.exception() is not None:
            log.error("rollout submission stopped: %r", task.exception())
            self._fail(task.exception())

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
            self._failed_event.set()

    def check(self) -> None:
        """Raise the error that stopped rollout, if any."""
        if self._error is not None:
            raise RolloutFailed(str(self._error)) from self._error

    # ---- submission -------------------------------------------------------------------------
    def _least_loaded(self) -> RolloutWorkerAPI:
        return min(self.workers, key=lambda w: self._inflight[id(w)])

    async def _submit_loop(self) -> None:
        while self._error is None:
            while self._next_index in self._skip:
                # Taken before the checkpoint this run resumed from: its row is drawn, so the
                # loader stays in step, but not generated again.
                self._skip.discard(self._next_index)
                self._next_index += 1
                self.loader.next_batch()
            await self.sem.acquire()
            if self._error is not None:  # rollout failed while this slot was awaited
                self.sem.release(accepted=False)
                return
            index = self._next_index
            self._next_index += 1
            self._loader_states[index] = self.loader.state_dict()
            row = self.loader.next_batch()[0]
            worker = self._least_loaded()
            key = f"{self.run_tag}{index}"
            self._inflight[id(worker)] += 1
            self._running[key] = (worker.node.node_id, time.monotonic())
            self.stats.submitted += 1
            self._sub_version[index] = self.sem.version
            task = asyncio.create_task(self._run_one(worker, index, key, row, self.sem.version))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            # A free slot is taken without suspending, so a large batch would be submitted in
            # one burst that starves the loop (heartbeats, replies: 30k groups kept it >10 s and
            # the nodes left as if the controller were lost); yield once a group instead.
            await asyncio.sleep(0)

    async def _run_one(
        self, worker: RolloutWorkerAPI, index: int, key: str, row: dict, version: int
    ) -> None:
        accepted = False
        result: Finished | None = None
        try:
            with self.tracer.span(worker.node.node_id, "generate", key=key, v=version) as span:
                reply = await worker.run_group(key, row)
                info, ref = check_group_report(reply, worker.node.node_id, key)
                span["tokens"] = 0 if ref is None else info.n_gen_tokens
            self._consecutive_failures = 0
            self.stats.rejected_samples += info.failed_samples
            if ref is None:  # the workflow rejected the row: no shard was stored
                self._reject(key, f"the workflow rejected it: {info.reason}")
                return
            if not self._accepts(key, info):
                await self.free([ref])
                return
            self._consecutive_rejections = 0
            accepted = True
            self.stats.accepted += 1
            result = Finished(ref, info, version)
        except NodeLost as e:
            self._fail(e)
        except BadReply as e:  # the node's code and ours disagree, or the peer is hostile
            self.stats.bad_replies += 1
            log.error("rollout of %s stopped: %s", key, e)
            self._fail(e)
        except RemoteError as e:
            if e.kind is ErrorKind.SERVER_EXITED:  # the node's inference server died: it leaves
                self._fail(e)
                return
            self.stats.failed += 1
            self.stats.timed_out += e.kind is ErrorKind.GROUP_TIMEOUT
            self._consecutive_failures += 1
            log.warning(
                "rollout of %s on %s failed: %s: %s",
                key,
                worker.node.node_id,
                e.type_name,
                e.remote_message,
            )
            if self._consecutive_failures >= self.max_consecutive_failures:
                self._fail(
                    RuntimeError(
                        f"{self._consecutive_failures} rollouts failed in a row; the last, on node "
                        f"{worker.node.node_id}: {e.type_name}: {e.remote_message}"
                    )
                )
        except Exception as e:  # a bug here must stop the run with its error, not vanish
            log.exception("rollout of %s on %s failed", key, worker.node.node_id)
            self._fail(e)
        finally:
            self._inflight[id(worker)] -= 1
            self._running.pop(key, None)
            self._last_finish = time.monotonic()
            self._done[index] = result
            self._changed.set()
            self.sem.release(accepted)

    def _accepts(self, key: str, info: GroupReport) -> bool:
        """The filter's verdict on a finished group; a rejection is counted (and bounded)."""
        if self.accept is None:
            return True
        name = getattr(self.accept, "__qualname__", repr(self.accept))
        try:
            ok = bool(self.accept(info))
        except Exception as e:  # user code: stop rollout with its error, not a silent hang
            self._fail(
                RuntimeError(
                    f"rollout filter {name} raised on {key}: {e!r} (a filter receives an "
                    "arl.protocol.report.GroupReport: read its attributes, e.g. "
                    "info.episode_rewards)"
                )
            )
            return False
        if not ok:
            rewards = list(info.episode_rewards)
            self._reject(key, f"rollout filter {name} rejected it (rewards {rewards})")
        return ok

    def _reject(self, key: str, why: str) -> None:
        """Count a rejected group; too many in a row stops rollout with a clear error (a filter
        that rejects everything must not hang training)."""
        self.stats.rejected += 1
        self._consecutive_rejections += 1
        log.debug("group %s rejected: %s", key, why)
        if self._consecutive_rejections >= self.max_consecutive_rejections:
            self._fail(
                RuntimeError(
                    f"{self._consecutive_rejections} prompt groups in a row were rejected "
                    f"(rollout.max_consecutive_rejections={self.max_consecutive_rejections}); "
                    f"the last, {key}: {why}. Loosen rollout.filter, fix the workflow, or raise "
                    "rollout.max_consecutive_rejections"
                )
            )

    # ---- consumption ------------------------------------------------------------------------
    async def prepare_batch(
        self, batch_size: int, version: int
    ) -> tuple[RTensor, list[GroupReport]]:
        """Wait for ``batch_size`` accepted groups (in ``order``) fit for training at ``version``.

        A group whose oldest token is more than eta versions behind ``version`` is dropped (its
        shard freed, and a replacement awaited) or kept, by ``stale_policy``.
        """
        taken: list[Finished] = []
        eta = self.sem.max_staleness
        while len(taken) < batch_size:
            self.check()
            index = self._next_ready(version, batch_size - len(taken))
            if index is None:
                self._changed.clear()
                fail = asyncio.ensure_future(self._failed_event.wait())
                changed = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait({fail, changed}, return_when=asyncio.FIRST_COMPLETED)
                fail.cancel()
                changed.cancel()
                continue
            item = self._done.pop(index)
            self._resolve(index)
            if item is None:
                continue
            self._accepted_taken += 1
            oldest = item.info.min_version
            if oldest >= 0 and is_stale(oldest, version, eta):
                if self.stale_policy == "drop":
                    self.stats.stale_dropped += 1
                    self._accepted_taken -= 1
                    self.sem.forget()  # its replacement takes its place in the budget
                    await self.free([item.ref])
                    continue
                self.stats.stale_kept += 1
            taken.append(item)
        return RTensor([t.ref for t in taken], peers=self.peers), [t.info for t in taken]

    def _next_ready(self, version: int, slots: int) -> int | None:
        """The index `prepare_batch` takes next at ``version`` with ``slots`` left, if that
        group has finished; None: wait.

        ``finished`` takes the first finished group that keeps every group within eta. A group
        submitted at version ``s`` must be trained by version ``s + eta``; the batches of
        versions ``v .. v + j`` hold ``slots + j * B`` groups, and only groups submitted by now
        compete for those before ``v + eta``. Where the groups due by ``v + j`` fill those
        slots, only a group due by then may take one, else the batch waits for one that is.
        The oldest group (the earliest due) always may.
        """
        oldest = self._next_take
        if self.order == "submitted":
            return oldest if oldest in self._done else None
        eta, per_batch = self.sem.max_staleness, self.sem.batch_size
        pending = [s for i, s in self._sub_version.items() if i not in self._done or self._done[i]]
        # limits[j]: the groups submitted by this version are due by version + j.
        limits = [version + j - eta for j in range(eta)]
        full = [
            sum(s <= limit for s in pending) >= slots + j * per_batch
            for j, limit in enumerate(limits)
        ]
        for index, item in self._done.items():
            if item is None:  # failed or rejected: skipped, it takes no slot
                return index
            sub = self._sub_version.get(index, version)
            if all(sub <= limit for limit, f in zip(limits, full, strict=True) if f):
                return index
        return None

    def _resolve(self, index: int) -> None:
        """Mark ``index`` taken (or skipped) and move ``_next_take`` past what is resolved."""
        self._taken_after.add(index)
        self._sub_version.pop(index, None)
        while self._next_take in self._taken_after:
            self._taken_after.discard(self._next_take)
            self._loader_states.pop(self._next_take, None)
            self._next_take += 1

    # ---- weight sync ------------------------------------------------------------------------
    async def pause(self, in_place: bool = False) -> None:
        """Stop generation on every worker not `held` (in-flight groups continue later: kept
        in their engine with ``in_place`` where it can, else aborted and resubmitted)."""
        await asyncio.gather(*(w.pause(in_place) for w in self._free_workers()))

    @asynccontextmanager
    async def held(
        self, workers: Sequence[int], *, sleep: bool = False, drop_weights: bool = False
    ) -> AsyncIterator[None]:
        """Generation of ``workers`` (indices) paused in place for the block, e.g. while the
        GPU they share with a train rank trains; a weight sync inside the block moves their
        version and leaves them paused until it ends.

        With ``sleep`` they are paused in abort mode and their engines sleep (KV cache freed,
        and with ``drop_weights`` the weights a sync rewrites): their groups stay in flight,
        the aborted generations resubmitted and waiting in the engine. The weight sync wakes
        them before its transfer (`paused`), so they generate again only with new weights."""
        idx = [i for i in dict.fromkeys(workers) if i not in self._held]
        t = self.tracer.clock()
        self._held.update(idx)
        try:
            # Inside the try: where one pause fails, the ones that succeeded are resumed below.
            if sleep:
                self._asleep.update(idx)
                freed = await asyncio.gather(*(self.workers[i].sleep(drop_weights) for i in idx))
                self.sleep_freed_bytes = sum(freed)
            else:
                await asyncio.gather(*(self.workers[i].pause(True) for i in idx))
            yield
        finally:
            self._held.difference_update(idx)
            # No sync woke them (the block failed, or held no sync): wake before resuming.
            woken = asyncio.gather(*self._wake(idx), return_exceptions=True)
            errors = [e for e in await woken if isinstance(e, BaseException)]
            resumed = asyncio.gather(
                *(self.workers[i].resume() for i in idx), return_exceptions=True
            )
            errors += [e for e in await resumed if isinstance(e, BaseException)]
            for i in idx:
                node = self.workers[i].node.node_id
                self.tracer.add(node, "held", t, self.tracer.clock(), lane="weights")
            if errors and sys.exc_info()[1] is None:  # else the error in flight says more
                raise errors[0]

    def _wake(self, idx: Iterable[int]) -> list[Awaitable[None]]:
        """Wake calls for the sleeping workers among ``idx`` (marked awake at once)."""
        waking = [i for i in idx if i in self._asleep]
        self._asleep.difference_update(waking)
        return [self.workers[i].wake() for i in waking]

    def _free_workers(self) -> list[RolloutWorkerAPI]:
        return [w for i, w in enumerate(self.workers) if i not in self._held]

    @asynccontextmanager
    async def paused(self, version: int, in_place: bool = False) -> AsyncIterator[None]:
        """Hold generation for a weight transfer (``in_place`` as in `pause`); resume at
        ``version`` whatever happens."""
        t = self.tracer.clock()
        # Engines asleep for a train phase wake first: the transfer writes into their memory.
        await asyncio.gather(*self._wake(list(self._asleep)))
        await self.pause(in_place)
        if not in_place:  # held workers keep their rows in place unless the sync aborts them
            await asyncio.gather(*(self.workers[i].pause(False) for i in self._held))
        try:
            yield
        finally:
            await self.resume(version)
            for w in self.workers:
                self.tracer.add(w.node.node_id, "paused", t, self.tracer.clock(), lane="weights")

    async def resume(self, version: int) -> None:
        """Stamp new tokens with ``version``, resume generation (not where `held`), widen the
        semaphore."""
        await asyncio.gather(*(w.set_version(version) for w in self.workers))
        await asyncio.gather(*(w.resume() for w in self._free_workers()))
        self.sem.set_version(version)

    # ---- recovery ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where a resumed run restarts: the loader position of the first group not yet taken,
        and the later groups already taken (``taken_after``), which it does not submit again.

        Every other group submitted after it (running, or finished but not taken) is generated
        again; with ``order="submitted"`` the resumed run trains the same batches in the same
        order as an uninterrupted one.
        """
        loader = self._loader_states.get(self._next_take, self.loader.state_dict())
        # Groups accepted but not taken are lost with the run: count only the taken ones.
        sem = {**self.sem.state_dict(), "accepted": self._accepted_taken}
        return {
            "loader": loader,
            "sem": sem,
            "next_index": self._next_take,
            "taken_after": sorted(self._taken_after),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` saved, before `start()`."""
        self.loader.load_state_dict(state["loader"])
        self.sem.load_state_dict(state["sem"])
        self._next_index = self._next_take = int(state["next_index"])
        self._taken_after = {int(i) for i in state.get("taken_after", ())}
        self._skip = set(self._taken_after)
        self._accepted_taken = int(state["sem"]["accepted"])


def check_group_report(
    reply: Any, node: str, key: str
) -> tuple[GroupReport, ShardRef] | tuple[RejectedGroup, None]:
    """A ``run_group`` reply as its report, with the shard ref (None for a group the workflow
    rejected); raises `BadReply` naming what is missing or wrong, so that a reply of the wrong
    shape fails visibly instead of as an error somewhere later."""
    try:
        info = report_from_wire(reply)
        if info.key != key:
            raise ReportError(f"it is for group {info.key!r}")
        if isinstance(info, RejectedGroup):
            return info, None
        return info, info.shard_ref(node)
    except ReportError as e:
        raise BadReply(node, f"rollout.run_group({key!r})", str(e)) from None
