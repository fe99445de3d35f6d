"""Own one inference-server subprocess: start it, wait until it is healthy, end it.

The server runs in its own process group (a new session), so ending it reaches every process
it spawned: SIGTERM to the group, then SIGKILL to whatever is left after a grace period. The
server also ends when its owner does: an ``atexit`` hook stops servers still running at a clean
interpreter exit, and on Linux the server gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``) if
the owner dies without running it (SIGKILL, a crash). The kernel sends that signal when the
*thread* that spawned the server exits, so start servers from the thread that owns them (the
event loop's).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import json as _json
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

import aiohttp

from arl.engines.base import WeightCheck, WeightTarget, refuse_target
from arl.engines.spec import SERVER_TRAITS
from arl.process import OwnedProcess, spawn
from arl.protocol.errors import ErrorKind
from arl.wire.addresses import free_port as free_port  # re-exported for the server engines

if TYPE_CHECKING:
    import torch

    from arl.engines.spec import EngineSpec

log = logging.getLogger(__name__)

_POLL_S = 0.05
_EXIT_GRACE_S = 1.0  # how long a failed request waits for the watchdog to confirm an exit

T = TypeVar("T")


class ServerError(RuntimeError):
    """An inference server could not be started, answered an error, or is gone."""


class ServerStartError(ServerError):
    """The server exited or did not become healthy in time; the message ends with its log."""

    error_kind = ErrorKind.SERVER_START


class ServerExited(ServerError):
    """The inference server exited while its engine was in use (killed, crashed, out of memory).

    The message names the server, its pid and exit status, and ends with the last lines of its
    log. Every request in flight when it exited, and every later one, raises it.
    """

    error_kind = ErrorKind.SERVER_EXITED


class ServerProcess:
    """One server subprocess in its own process group, with health wait and a sure shutdown.

    `start` spawns ``argv`` with stdout and stderr going to ``log_path``, then polls
    ``GET http://host:port{health_path}`` until it answers 200. `stop` (or `stop_sync`) ends the
    whole process group.
    """

    _live: set[ServerProcess] = set()  # servers to end at interpreter exit
    _atexit_registered = False

    def __init__(
        self,
        argv: Sequence[str],
        *,
        host: str,
        port: int,
        health_path: str = "/health",
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        log_path: str | None = None,
        name: str = "server",
    ) -> None:
        if not argv:
            raise ValueError("argv is empty: give the command that starts the server")
        self.argv = [str(a) for a in argv]
        self.host = host
        self.port = port
        self.health_path = health_path
        self.env = dict(env) if env is not None else None
        self.cwd = cwd
        self.name = name
        # Without a log_path, `start` makes a temp file; it is removed after a clean stop and
        # kept when the server failed, for the post-mortem the error message points to.
        self._owns_log = log_path is None
        self.log_path = log_path
        self._owned: OwnedProcess | None = None
        self._proc: subprocess.Popen | None = None  # self._owned's leader
        self._healthy = False

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the server."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's pid (also its process group id), or None before `start`."""
        return self._proc.pid if self._proc is not None else None

    def running(self) -> bool:
        """True while the server's main process has not exited."""
        return self._proc is not None and self._proc.poll() is None

    async def wait_exit(self, poll_s: float = 0.2) -> int:
        """Wait until the server's main process exits; returns its exit code (-N: signal N)."""
        if self._proc is None:
            raise ServerError(f"{self.name} was not started")
        while (code := self._proc.poll()) is None:
            await asyncio.sleep(poll_s)
        return code

    def exit_error(self) -> ServerExited:
        """A `ServerExited` describing how the (exited) server ended, with its log's last lines."""
        code = self._proc.poll() if self._proc is not None else None
        if code is None:
            status = "still running"
        elif code < 0:
            status = f"killed by signal {_signal_name(-code)}, exit code {code}"
        else:
            status = f"exit code {code}"
        lines = self.log_tail(4000).splitlines()[-20:]
        return ServerExited(
            f"{self.name} inference server exited (pid {self.pid}, {status}); command: "
            f"{' '.join(self.argv)}\n--- last lines of {self.log_path} ---\n" + "\n".join(lines)
        )

    def log_tail(self, n_chars: int = 3000) -> str:
        """The last ``n_chars`` of the server's log."""
        if self.log_path is None:
            return "<no log: the server was not started>"
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - n_chars))
                return fh.read().decode("utf-8", "replace")
        except OSError as exc:
            return f"<log {self.log_path} unreadable: {exc}>"

    async def start(self, timeout_s: float) -> None:
        """Spawn the server and wait until its health endpoint answers 200.

        Raises `ServerStartError` (and ends the server) if it exits first or is not healthy
        within ``timeout_s`` seconds.
        """
        if self._proc is not None:
            raise ServerError(f"{self.name} was already started (pid {self._proc.pid})")
        env = None if self.env is None else {**os.environ, **self.env}
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix=f"arl-{self.name}-", suffix=".log")
            os.close(fd)
        log.info("starting %s: %s (log %s)", self.name, " ".join(self.argv), self.log_path)
        with open(self.log_path, "ab") as log_fh:
            try:
                # Spawned on this (the loop's) thread, not in an executor: the parent-death
                # signal fires when the spawning thread exits. fork+exec is brief.
                self._owned = spawn(
                    self.argv, env=env, cwd=self.cwd, stdout=log_fh, stderr=subprocess.STDOUT
                )
                self._proc = self._owned.popen
            except OSError as exc:
                if self._owns_log:
                    os.unlink(self.log_path)  # empty: nothing ran
                raise ServerStartError(
                    f"cannot run {self.argv[0]!r} to start {self.name}: {exc}; check the "
                    "python executable / command configured for this engine"
                ) from exc
        ServerProcess._track(self)
        try:
            await self._wait_healthy(timeout_s)
        except BaseException:
            await self.stop()
            raise
        self._healthy = True
        log.info("%s healthy at %s (pid %d)", self.name, self.base_url, self._proc.pid)

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = self.base_url + self.health_path
        probe_timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=probe_timeout) as session:
            while True:
                code = self._proc.poll()
                if code is not None:
                    raise ServerStartError(
                        f"{self.name} exited with code {code} before it became healthy; "
                        f"command: {' '.join(self.argv)}\n--- {self.log_path} (tail) ---\n"
                        f"{self.log_tail()}"
                    )
                try:
                    async with session.get(url) as resp:
                        if resp.status == 200:
                            return
                except (TimeoutError, aiohttp.ClientError):
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{self.name} was not healthy at {url} within {timeout_s:.0f} s; raise "
                        f"the start timeout if it is just slow\n--- {self.log_path} (tail) ---\n"
                        f"{self.log_tail()}"
                    )
                await asyncio.sleep(0.5)

    async def stop(self, grace_s: float = 15.0) -> None:
        """End the server's whole process group: SIGTERM, then SIGKILL after ``grace_s``.

        Safe to call more than once.
        """
        if self._owned is None:
            return
        clean = self._proc.poll() is None and self._healthy
        self._finish(await self._owned.stop(grace_s), clean)

    def stop_sync(self, grace_s: float = 5.0) -> None:
        """Blocking `stop`, for interpreter exit and other places without an event loop."""
        if self._owned is None:
            return
        clean = self._proc.poll() is None and self._healthy
        self._finish(self._owned.stop_sync(grace_s), clean)

    def _finish(self, killed: bool, clean: bool) -> None:
        if killed:
            log.warning("%s (pgid %d) ignored SIGTERM; it was sent SIGKILL", self.name, self.pid)
        ServerProcess._live.discard(self)
        if clean and self._owns_log:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)
        self._healthy = False

    @classmethod
    def _track(cls, server: ServerProcess) -> None:
        cls._live.add(server)
        if not cls._atexit_registered:
            atexit.register(cls._stop_all)
            cls._atexit_registered = True

    @classmethod
    def _stop_all(cls) -> None:
        for server in list(cls._live):
            server.stop_sync()


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


class HttpServerEngine:
    """What the server-backed engines (vllm, sglang) share: their server, an HTTP session, the
    pause gate and version stamping. Subclasses add `agenerate` and the server's endpoints.
    A pause always aborts: the servers' own in-place pause modes are not used yet."""

    # Version stamping: weights change only while paused, and both servers return from their
    # pause call only after every running request has been aborted and answered. So a
    # response's tokens were generated in the running window in which the response arrived,
    # whose version is `_window_version`: `version` as it was at the last `resume` (or at a
    # `set_version` while running). A request that reaches the server just after a pause is
    # held there and runs after the resume, so the new window's version is right for it too.

    name: ClassVar[str] = "server"
    # Declared in `arl.engines.spec.SERVER_TRAITS` (both servers' entry of `TRAITS`), which the
    # launcher reads without importing the engines.
    weight_targets: ClassVar[frozenset[WeightTarget]] = SERVER_TRAITS.weight_targets
    weights_device: ClassVar[None] = None  # it takes no tensors from this process
    pause_in_place: ClassVar[bool] = SERVER_TRAITS.pause_in_place
    can_sleep: ClassVar[bool] = SERVER_TRAITS.can_sleep
    serves_lora: ClassVar[bool] = SERVER_TRAITS.serves_lora
    weight_check: ClassVar[WeightCheck] = SERVER_TRAITS.weight_check
    version: int

    def __init__(
        self,
        server: ServerProcess,
        *,
        start_timeout_s: float,
        request_timeout_s: float,
        max_connections: int,
    ) -> None:
        self.server = server
        self.version = 0
        self._window_version = 0
        self._start_timeout_s = start_timeout_s
        self._request_timeout_s = request_timeout_s
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        # The LoRA adapter requests are served with (its name on the server), None: the base.
        self.adapter: str | None = None
        self._asleep = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._inflight = 0
        # The watchdog: set when the server exits while the engine is open (not by `aclose`).
        self._failure: ServerExited | None = None
        self._failed = asyncio.Event()
        self._watchdog: asyncio.Task | None = None

    @classmethod
    def from_spec(cls, spec: EngineSpec, **options: object) -> HttpServerEngine:
        """The engine of a rollout node's `EngineSpec` (every setting of the spec reaches the
        server's command line); ``options`` are further constructor arguments (``env``...)."""
        return cls(  # type: ignore[call-arg] - the subclasses take these keywords
            spec.model_path,
            python=spec.python,
            server_args=spec.server_args,
            tp_size=spec.tp_size,
            dtype=spec.dtype,
            seed=spec.seed,
            start_timeout_s=spec.start_timeout_s,
            lora_rank=spec.lora_rank,
            sleep_mode=spec.sleep_mode,
            **options,
        )

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the server."""
        return self.server.base_url

    async def start(self) -> None:
        """Start the server and wait until it is healthy (``start_timeout_s``)."""
        await self.server.start(self._start_timeout_s)
        # No total timeout on the session: a long generation is not an error. Control calls set
        # their own timeout.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._max_connections),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
        )
        self._watchdog = asyncio.create_task(self._watch(), name=f"arl-{self.name}-watch")

    async def _watch(self) -> None:
        """Notice the server's exit at once, not at the next request: fail what is in flight."""
        await self.server.wait_exit()
        self._failure = self.server.exit_error()
        log.error("%s", self._failure)
        self._failed.set()

    async def wait_failed(self) -> ServerExited:
        """Wait until the server exits on its own (never returns after a clean `aclose`)."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    async def aclose(self) -> None:
        """Close the HTTP session and end the server (its whole process group)."""
        if self._watchdog is not None:  # an exit caused by aclose() is not a failure
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
            self._watchdog = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        # After a crash, what is left of the server's group gets no long grace: nothing of it
        # is worth a clean shutdown, and its node is leaving.
        await self.server.stop(grace_s=2.0 if self._failure is not None else 15.0)

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.aclose()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Refused: a server takes no tensors from this process (`weight_targets`)."""
        raise refuse_target(self, WeightTarget.TENSORS)

    async def update_weights_from_disk(self, path: str) -> None:
        """Load the HF-format folder ``path`` (paused); each server has its own endpoint."""
        raise NotImplementedError

    async def weights_checksum(self) -> None:
        """None: a server exposes no checksum of its weights; verify them with `score`."""
        return None

    async def score(self, token_ids: Sequence[int]) -> list[float]:
        """Log-probs of ``token_ids[1:]`` under the weights held now; each server's own call."""
        raise NotImplementedError

    def set_version(self, version: int) -> None:
        """Set the policy version stamped on tokens generated from now on."""
        self.version = version
        if self._resumed.is_set():
            self._window_version = version

    async def pause(self, in_place: bool = False) -> None:
        """Hold new requests here and abort in-flight ones on the server (they return "abort");
        ``in_place`` is not honoured (`pause_in_place` is False): they are aborted too."""
        self._resumed.clear()
        await self._server_pause()

    async def resume(self) -> None:
        """Open the new running window at the current version and let requests through."""
        if self._asleep:
            raise ServerError(f"resume() on a sleeping {self.name} server: `await wake()` first")
        self._window_version = self.version
        await self._server_resume()
        self._resumed.set()

    async def health(self) -> dict:
        """Server liveness and engine state; raises `ServerError` if the server is unusable."""
        if self._failure is not None:
            raise self._failure
        if not self.server.running():
            raise ServerError(
                f"{self.name} server (pid {self.server.pid}) is not running; see its log "
                f"{self.server.log_path}"
            )
        await self._request("GET", self._health_path())
        return {
            "engine": self.name,
            "url": self.base_url,
            "pid": self.server.pid,
            "version": self.version,
            "paused": not self._resumed.is_set(),
            "inflight": self._inflight,
            "asleep": self._asleep,
            "adapter": self.adapter,
        }

    async def sleep(self, drop_weights: bool = False) -> int:
        """Pause (abort) and release the server's GPU memory through its sleep endpoint; the
        server measures nothing it reports, so this returns 0. ``drop_weights`` is the
        server's choice (see each server's `_server_sleep`)."""
        await self.pause()
        if not self._asleep:
            await self._server_sleep(drop_weights)
            self._asleep = True
        return 0

    async def wake(self) -> None:
        """Reallocate what `sleep` released; stays paused until `resume`."""
        if self._asleep:
            await self._server_wake()
            self._asleep = False

    async def load_adapter(self, path: str) -> str:
        """Load the peft adapter folder ``path`` under a versioned name (``arl-<folder>``, the
        disk sync's folders being ``v<N>``), serve requests with it, and unload the one it
        replaces; returns the name (call while paused)."""
        name = f"arl-{os.path.basename(os.path.normpath(path))}"
        old = self.adapter
        if old == name:  # the same folder again: a server refuses a name it already has
            await self._server_unload_adapter(old)
            old = self.adapter = None
        await self._server_load_adapter(name, str(path))
        self.adapter = name
        if old is not None:
            await self._server_unload_adapter(old)
        return name

    async def _server_sleep(self, drop_weights: bool) -> None:
        raise NotImplementedError

    async def _server_wake(self) -> None:
        raise NotImplementedError

    async def _server_load_adapter(self, name: str, path: str) -> None:
        raise NotImplementedError

    async def _server_unload_adapter(self, name: str) -> None:
        raise NotImplementedError

    def _health_path(self) -> str:
        """The endpoint `health` probes; servers whose health check generates override it."""
        return self.server.health_path

    async def _server_pause(self) -> None:
        raise NotImplementedError

    async def _server_resume(self) -> None:
        raise NotImplementedError

    async def _admit(self) -> None:
        """Wait while paused: a request sent now would only be held by the server."""
        await self._guard(self._resumed.wait())

    async def _guard(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` unless the server exits first; then raise its `ServerExited`."""
        if self._failure is not None:
            if inspect.iscoroutine(aw):
                aw.close()  # never started
            raise self._failure
        task = asyncio.ensure_future(aw)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            await asyncio.wait({task, failed}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        await asyncio.gather(task, return_exceptions=True)  # the server exited first
        assert self._failure is not None
        raise self._failure

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise ServerError(
                f"{self.name} engine is not started (or closed): call `await "
                "engine.start()` or use `async with`"
            )
        return self._session

    def _control_timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self._request_timeout_s)

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json: object = None,
        params: Mapping[str, str] | None = None,
        control: bool = True,
    ) -> object:
        """Send one request; return the decoded JSON body (or the text when it is not JSON).

        Raises `ServerError` naming the endpoint, the status and the server's message on any
        status other than 200.
        """
        timeout = self._control_timeout() if control else None
        url = self.base_url + path

        async def send() -> tuple[str, str]:
            async with self._http().request(
                method, url, json=json, params=params, timeout=timeout
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise ServerError(
                        f"{self.name} {method} {path} failed with HTTP {resp.status}: {text[:1000]}"
                    )
                return text, resp.content_type

        try:
            text, content_type = await self._guard(send())
        except aiohttp.ClientError as exc:
            # A dropped connection is usually the server dying: give the watchdog a moment to
            # see the exit, so the caller learns why (exit status, log) rather than "reset".
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._failed.wait(), _EXIT_GRACE_S)
            if self._failure is not None:
                raise self._failure from exc
            alive = "running" if self.server.running() else "not running"
            raise ServerError(
                f"{self.name} {method} {path} at {self.base_url} failed: {exc!r} (server "
                f"{alive}; log {self.server.log_path})"
            ) from exc
        if content_type == "application/json":
            return _json.loads(text)
        return text
