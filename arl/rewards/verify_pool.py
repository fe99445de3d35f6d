"""math-verify under a hard timeout, in long-lived worker processes that can be killed.

math-verify's own timeouts use ``signal.alarm``, which fails off the main thread; here each check
runs in a worker (``python -m arl.rewards.verify_pool SCORER``) that gets JSON lines on stdin and
answers on stdout (no pickle). ``SCORER`` is the import path of ``score(gold, answer) -> float``,
`math_verify_score` unless the pool is given another. A worker that overruns its timeout is
killed and replaced; the call returns 0.0 and counts a timeout. Under the hood the calls are
blocking pipe I/O on threads: `verify_sync` works from any thread, and `verify` runs it on the
pool's thread executor, so one pool serves any number of event loops over a process lifetime.
Workers exit on stdin EOF: when the pool closes or the parent dies, even while stuck in a check.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import itertools
import json
import logging
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

log = logging.getLogger(__name__)

DEFAULT_SCORER = "arl.rewards.verify_pool:math_verify_score"


class VerifyPoolClosed(RuntimeError):
    """The pool was closed; create a new one (or use `default_pool()`)."""


class VerifyWorkerError(RuntimeError):
    """A worker process could not start (its stderr is the parent's stderr)."""


@attrs.define
class PoolStats:
    """Counters of a `VerifyPool`: calls, timeouts, errors (worker-side or a dead worker)."""

    calls: int = 0
    timeouts: int = 0
    errors: int = 0
    restarts: int = 0


class _WorkerDied(Exception):
    pass


class _Worker:
    """One worker process and the parent's end of its pipes."""

    def __init__(self, scorer: str) -> None:
        self.scorer = scorer
        env = dict(os.environ)
        # The child must import this very arl, also when it is not installed (PYTHONPATH runs).
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "arl.rewards.verify_pool", scorer],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # Ctrl-C goes to the parent; the workers follow via EOF
        )
        self._fd = self.proc.stdout.fileno()
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._fd, selectors.EVENT_READ)
        self._buf = bytearray()
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        if self.ready:
            return
        try:
            hello = self._read_line(time.monotonic() + timeout)
        except (TimeoutError, _WorkerDied) as exc:
            raise VerifyWorkerError(
                f"verify worker pid {self.proc.pid} did not start within {timeout:.0f} s "
                f"({type(exc).__name__}); check that math-verify and the scorer {self.scorer} "
                f"import in {sys.executable}"
            ) from exc
        if not hello.get("ready"):
            raise VerifyWorkerError(f"verify worker sent {hello!r} instead of its ready line")
        self.ready = True

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        try:
            self.proc.stdin.write(json.dumps(msg).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:  # ValueError: stdin already closed
            raise _WorkerDied(f"worker pid {self.proc.pid} is gone") from exc
        return self._read_line(time.monotonic() + timeout)

    def _read_line(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._sel.select(remaining):
                raise TimeoutError
            chunk = os.read(self._fd, 65536)
            if not chunk:
                raise _WorkerDied(f"worker pid {self.proc.pid} exited ({self.proc.poll()})")
            self._buf += chunk
        line, _, rest = self._buf.partition(b"\n")
        self._buf = bytearray(rest)
        return json.loads(line)

    def close(self, grace: float) -> None:
        """EOF first (the worker exits by itself), then kill; always reaps the process."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._sel.close()
        self.proc.stdout.close()


class VerifyPool:
    """A pool of ``n_workers`` math-verify worker processes with a hard per-call timeout.

    ``await pool.verify(gold, answer)`` or ``pool.verify_sync(...)`` returns 1.0 if the answer
    equals the gold, else 0.0 (also on timeout or error, counted in `stats`). Workers start on
    first use; `close()`/`aclose()` or ``async with`` ends them. ``scorer`` is the
    ``module:function`` the workers score with, ``score(gold, answer) -> float``.
    """

    def __init__(
        self,
        n_workers: int = 2,
        startup_timeout: float = 120.0,
        scorer: str = DEFAULT_SCORER,
    ) -> None:
        if n_workers < 1:
            raise ValueError(f"n_workers={n_workers}: a pool needs at least one worker")
        if scorer.count(":") != 1 or not all(scorer.split(":")):
            raise ValueError(f"scorer={scorer!r}: give the import path as 'module:function'")
        self.n_workers = n_workers
        self.startup_timeout = startup_timeout
        self.scorer = scorer
        # A slot holds a live worker or None (spawned on next use); taking one bounds concurrency.
        self._slots: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(n_workers):
            self._slots.put(None)
        self._live: set[_Worker] = set()
        self._lock = threading.Lock()
        self._stats = PoolStats()
        self._ids = itertools.count()
        self._executor: ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def stats(self) -> PoolStats:
        """A snapshot of the counters."""
        with self._lock:
            return attrs.evolve(self._stats)

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers (started lazily, so empty before the first call)."""
        with self._lock:
            return sorted(w.proc.pid for w in self._live)

    def start(self) -> None:
        """Spawn every worker not running yet, without waiting for it to be ready: its imports
        (~0.3-1 s) then overlap whatever the caller does next instead of the first calls."""
        self._check_open()
        taken: list[_Worker | None] = []
        try:
            for _ in range(self.n_workers):
                taken.append(self._slots.get_nowait())
        except queue.Empty:  # the others are busy, so they run already
            pass
        try:
            for i, worker in enumerate(taken):
                if worker is None:
                    taken[i] = self._spawn()
        finally:
            for worker in taken:
                self._slots.put(worker)

    async def verify(self, gold: str, answer: str, timeout: float = 5.0) -> float:
        """1.0 if ``answer`` (parsed, \\boxed{} preferred) equals ``gold``, else 0.0."""
        self._check_open()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._get_executor(), self.verify_sync, gold, answer, timeout
        )

    def verify_sync(self, gold: str, answer: str, timeout: float = 5.0) -> float:
        """Blocking `verify`, callable from any thread."""
        if timeout <= 0:
            raise ValueError(f"timeout={timeout}: must be positive seconds")
        self._check_open()
        worker = self._slots.get()
        try:
            if worker is None:
                worker = self._spawn()
            worker.wait_ready(self.startup_timeout)
            self._count("calls")
            req_id = next(self._ids)
            reply = worker.request({"id": req_id, "gold": gold, "answer": answer}, timeout)
            if reply.get("id") != req_id:
                raise _WorkerDied(
                    f"worker pid {worker.proc.pid} answered request {req_id} with {reply!r}"
                )
        except TimeoutError:
            self._count("timeouts")
            log.warning(
                "math-verify exceeded %.1f s; killing worker pid %d", timeout, worker.proc.pid
            )
            worker = self._replace(worker)
            return 0.0
        except _WorkerDied as exc:
            self._check_open()
            self._count("errors")
            log.warning("verify worker died mid-request (%s); starting a new one", exc)
            worker = self._replace(worker)
            return 0.0
        except VerifyWorkerError:
            worker = self._replace(worker, respawn=False)
            raise
        finally:
            if self._closed and worker is not None:  # closed meanwhile: nobody else will reap it
                self._discard(worker)
                worker = None
            self._slots.put(worker)
        if "error" in reply:
            self._count("errors")
            log.debug("math-verify error for gold %r: %s", gold, reply["error"])
            return 0.0
        return float(reply["result"])

    def close(self) -> None:
        """End every worker (EOF, then kill) and the thread executor; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        idle: list[_Worker | None] = []
        while True:
            try:
                idle.append(self._slots.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            busy = self._live.difference(idle)
        for w in busy:  # its calling thread sees EOF at once and reaps it
            w.proc.kill()
        for w in idle:
            if w is not None:
                with self._lock:
                    self._live.discard(w)
                w.close(grace=2.0)
        for _ in idle:  # a thread waiting for a slot wakes, and finds the pool closed
            self._slots.put(None)
        if self._executor is not None:
            # Queued calls still run and raise VerifyPoolClosed, rather than vanish as cancelled.
            self._executor.shutdown(wait=False)

    async def aclose(self) -> None:
        """`close()` off the event loop (it waits for processes to exit)."""
        await asyncio.to_thread(self.close)

    async def __aenter__(self) -> VerifyPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _spawn(self) -> _Worker:
        with self._lock:
            if self._closed:
                raise VerifyPoolClosed("the verify pool is closed")
            worker = _Worker(self.scorer)
            self._live.add(worker)
            return worker

    def _discard(self, worker: _Worker) -> None:
        with self._lock:
            self._live.discard(worker)
        worker.proc.kill()
        worker.close(grace=0.0)

    def _replace(self, worker: _Worker, respawn: bool = True) -> _Worker | None:
        """Kill ``worker``; start its successor now so its imports overlap other work."""
        self._discard(worker)
        if not respawn or self._closed:
            return None
        self._count("restarts")
        return self._spawn()

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + 1)

    def _check_open(self) -> None:
        if self._closed:
            raise VerifyPoolClosed("the verify pool is closed; create a new VerifyPool")

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.n_workers, thread_name_prefix="arl-verify")
            return self._executor


_default: VerifyPool | None = None
_default_lock = threading.Lock()


def start_default_pool() -> None:
    """Start the default pool's workers now (a reward's ``warm_up``; see `arl.rewards.gsm8k`)."""
    default_pool().start()


def default_pool() -> VerifyPool:
    """The process-wide pool the reward functions use, created on first use, closed at exit."""
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = VerifyPool()
            atexit.register(_default.close)
        return _default


def math_verify_score(gold: str, answer: str) -> float:
    """1.0 if math-verify finds ``answer`` (\\boxed{} preferred) equal to ``gold``, else 0.0."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_parsed = parse(
        gold, [LatexExtractionConfig(), ExprExtractionConfig()], parsing_timeout=None
    )
    if not gold_parsed:
        raise ValueError(f"gold answer {gold!r} did not parse as an expression or LaTeX")
    answer_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    answer_parsed = parse(answer, answer_config, parsing_timeout=None)
    return 1.0 if verify(gold_parsed, answer_parsed, timeout_seconds=None) else 0.0


def _load_scorer(spec: str) -> Callable[[str, str], float]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _worker_main(scorer_spec: str) -> None:
    """Serve JSON-line requests ``{id, gold, answer}`` -> ``{id, result}`` or ``{id, error}``."""
    # Only our replies may reach the protocol pipe: anything else printing goes to stderr.
    proto = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # The parent enforces the timeout, so math-verify's "timeout is disabled" warning is noise.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401 - import before saying ready, so startup is not timed as work

    score = _load_scorer(scorer_spec)
    if scorer_spec == DEFAULT_SCORER:
        # math-verify's first check builds its parsers (~50 ms); pay that before saying ready.
        try:
            score("1", "\\boxed{1}")
        except Exception:  # noqa: BLE001 - a failing check fails each call, answered as errors
            pass
    requests: queue.SimpleQueue[bytes] = queue.SimpleQueue()

    def read_stdin() -> None:
        for line in sys.stdin.buffer:
            requests.put(line)
        os._exit(0)  # EOF: the pool closed or the parent died; exit even mid-check

    threading.Thread(target=read_stdin, daemon=True).start()
    proto.write(json.dumps({"ready": True, "pid": os.getpid()}).encode() + b"\n")
    proto.flush()
    while True:
        line = requests.get()
        req_id = None
        try:
            req = json.loads(line)
            req_id = req["id"]
            reply = {"id": req_id, "result": float(score(req["gold"], req["answer"]))}
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error reply
            reply = {"id": req_id, "error": f"{type(exc).__name__}: {exc}"}
        proto.write(json.dumps(reply).encode() + b"\n")
        proto.flush()


if __name__ == "__main__":
    _worker_main(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_SCORER)
