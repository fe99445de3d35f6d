"""`LoopSocket`: a plain ``zmq.Socket`` driven from the running asyncio loop (plain or uvloop).

It reads and writes with ``NOBLOCK`` directly and waits on the socket's FD only when an operation
would block, where ``zmq.asyncio`` re-registers readers and spends extra loop rounds per message;
``python -m arl.bench transport`` measures both beside plain sync pyzmq.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import zmq

# Plain ints: pyzmq's enum members cost microseconds per operation in `|` and lookups.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_RCVMORE = int(zmq.RCVMORE)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
# A send that ZMQ refused although the socket reported POLLOUT (a ROUTER with ROUTER_MANDATORY
# always reports POLLOUT, whichever peer is full) is retried on every FD wake-up and, as a
# backstop, after these delays (doubling), since its peer's wake-up may be consumed unseen.
_RETRY_FIRST_S = 0.001
_RETRY_MAX_S = 0.016
# A receive that finds a message queued returns it without suspending, so a loop that receives
# and starts a task per message drains a whole backlog in one turn of the event loop, and every
# task it started then takes its first step in the next turn, before any timer (a heartbeat)
# runs. Such loops suspend once per this many messages (`yield_every`): a turn then holds at
# most this many tasks' first steps. 300k queued rollout calls were one turn of over 10 s.
RECV_BURST = 64
# Messages one `_serve` moves before it lets the loop run a turn and goes on in the next: a
# backlog of queued sends (300k calls to a node that had fallen behind) was otherwise sent in
# one callback for as long as the peer kept taking them, 32 s in which no heartbeat went out.
_SERVE_BUDGET = 256


async def yield_every(count: int, burst: int = RECV_BURST) -> int:
    """Count one handled message; at every ``burst``-th, let the loop run a turn. Returns the
    new count: ``n = await yield_every(n)`` in a receive loop."""
    count += 1
    if count >= burst:
        await asyncio.sleep(0)
        return 0
    return count


class SocketClosed(zmq.ZMQError):
    """The socket was closed while a send, receive or poll was waiting on it."""

    def __init__(self) -> None:
        super().__init__(zmq.ENOTSOCK, "the socket was closed while this call waited on it")


class _Waiter:
    """One suspended call: its future and, for a send, what to send."""

    __slots__ = ("future", "frames", "copy", "track", "flags")

    def __init__(
        self,
        future: asyncio.Future,
        frames: Any = None,
        copy: bool = True,
        track: bool = False,
        flags: int = 0,  # poll: the events waited for
    ):
        self.future, self.frames, self.copy, self.track = future, frames, copy, track
        self.flags = flags


class LoopSocket:
    """A plain ``zmq.Socket`` driven by the running asyncio loop (plain asyncio or uvloop).

    ``await send_multipart(frames)`` and ``await recv_multipart()`` run the operation with
    NOBLOCK at once and wait on the socket's FD only when it would block (no message, HWM, no
    peer yet). Concurrent callers are served in call order (on a ROUTER, per peer); a cancelled
    receive never loses a message. Options, bind, connect and monitor are the wrapped socket's
    (``s.linger = 0`` sets the option). Use it from one event loop and close it on that loop.
    """

    __slots__ = (
        "socket",
        "_loop",
        "_fd",
        "_router",
        "_recv_waiters",
        "_send_queues",
        "_poll_waiters",
        "_stash",
        "_retry",
        "_retry_delay",
        "_again",
        "_closed",
    )

    def __init__(self, socket: zmq.Socket):
        # A socket class with its own waiting (zmq.asyncio) would hand futures to _serve.
        kind = type(socket)
        if (
            not isinstance(socket, zmq.Socket)
            or kind.send is not zmq.Socket.send
            or kind.recv is not zmq.Socket.recv
        ):
            raise TypeError(
                f"LoopSocket wraps a plain zmq.Socket, got {type(socket).__name__}; create it "
                "with ctx.socket(kind, socket_class=zmq.Socket)"
            )
        self.socket = socket
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        self._router = socket.getsockopt(zmq.TYPE) == zmq.ROUTER
        self._recv_waiters: deque[_Waiter] = deque()
        # Sends waiting, in order, per destination: the peer identity on a ROUTER (one full
        # peer must not hold up the others), None on every other kind of socket.
        self._send_queues: dict[bytes | None, deque[_Waiter]] = {}
        self._poll_waiters: list[_Waiter] = []
        self._stash: deque[list] = deque()  # messages handed to receivers that were cancelled
        self._retry: asyncio.TimerHandle | None = None
        self._retry_delay = _RETRY_FIRST_S
        self._again: asyncio.Handle | None = None  # `_serve` goes on in the next turn
        self._closed = False

    def __repr__(self) -> str:
        return f"LoopSocket({self.socket!r})"

    def __getattr__(self, name: str) -> Any:
        if name in LoopSocket.__slots__:  # not set yet
            raise AttributeError(name)
        if name.startswith(("send", "recv")):
            raise AttributeError(
                f"LoopSocket has no {name}(): it would block the event loop; "
                "use `await send_multipart(...)` / `await recv_multipart()`"
            )
        return getattr(self.socket, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in LoopSocket.__slots__:
            object.__setattr__(self, name, value)
        else:  # a zmq option: s.linger = 0, s.curve_publickey = ...
            setattr(self.socket, name, value)

    # ---- the calls ---------------------------------------------------------------------------

    async def recv_multipart(self, flags: int = 0, copy: bool = True) -> list[Any]:
        """The next message: ``zmq.Frame`` objects with ``copy=False`` (no copy), else bytes.

        With ``flags=zmq.NOBLOCK`` raises ``zmq.Again`` instead of waiting.
        """
        if self._closed:
            raise SocketClosed()
        serve = True
        if not self._recv_waiters:
            if self._stash:
                return _as_copy(self._stash.popleft(), copy)
            # Reading EVENTS first is cheaper than a receive that fails (libzmq then checks its
            # commands twice, and pyzmq builds an exception), and most receives find nothing.
            if self.socket.getsockopt(_EVENTS) & _POLLIN:
                frames = self._recv_now(copy)
                if frames is not None:
                    if self._send_queues or self._poll_waiters:
                        self._serve()  # the receive may have taken the wake-up they wait for
                    return frames
            else:  # that read left nothing for this receive; others may wait for its wake-up
                serve = bool(self._send_queues or self._poll_waiters)
            if flags & _NOBLOCK:
                raise zmq.Again()
        elif flags & _NOBLOCK:
            raise zmq.Again()
        waiter = _Waiter(self._attach().create_future(), copy=copy)
        self._recv_waiters.append(waiter)
        if serve:
            self._serve()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            _drop_cancelled(self._recv_waiters, waiter)
            fut = waiter.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Handed a message, then cancelled before it resumed: the next receiver gets it.
                self._stash.append(fut.result())
                self._serve()
            raise

    async def send_multipart(
        self, msg_parts: list[Any], flags: int = 0, copy: bool = True, track: bool = False
    ) -> Any:
        """Send one multipart message (frames may be bytes, buffers or ``zmq.Frame``).

        Waits while ZMQ would block: no peer connected yet, the high-water mark reached, or
        (ROUTER with ROUTER_MANDATORY) that peer's queue full; with ``flags=zmq.NOBLOCK`` raises
        ``zmq.Again`` instead. A ROUTER raises ``zmq.ZMQError(EHOSTUNREACH)`` for an unknown peer
        when ROUTER_MANDATORY is set. A send cancelled before ZMQ took it is not sent.
        """
        if self._closed:
            raise SocketClosed()
        _check_frames(msg_parts)
        queues = self._send_queues
        key = _peer_key(msg_parts) if self._router and queues else None
        if key not in queues:
            try:
                tracker = self._send_now(msg_parts, copy, track)
            except zmq.Again:
                if flags & _NOBLOCK:
                    raise
            else:
                if self._recv_waiters or queues or self._poll_waiters:
                    self._serve()  # the send may have taken the FD wake-up they wait for
                return tracker
            if self._router:
                key = _peer_key(msg_parts)
        elif flags & _NOBLOCK:
            raise zmq.Again()
        waiter = _Waiter(self._attach().create_future(), msg_parts, copy, track)
        queues.setdefault(key, deque()).append(waiter)
        self._serve()
        try:
            return await waiter.future
        except asyncio.CancelledError:
            queue = queues.get(key)
            if queue is not None:
                _drop_cancelled(queue, waiter)
                if not queue:
                    del queues[key]
            raise

    async def poll(self, timeout: float | None = None, flags: int = _POLLIN) -> int:
        """Wait until the socket can receive (``zmq.POLLIN``) or send (``zmq.POLLOUT``).

        Returns the ready events among ``flags``, or 0 when ``timeout`` milliseconds passed
        first (``None`` or a negative timeout waits for ever), like ``zmq.asyncio``.
        """
        if self._closed:
            raise SocketClosed()
        waiter = _Waiter(self._attach().create_future(), flags=flags)
        self._poll_waiters.append(waiter)
        self._serve()
        try:
            if waiter.future.done() or timeout is None or timeout < 0:
                return await waiter.future
            try:
                async with asyncio.timeout(timeout / 1000):
                    return await waiter.future
            except TimeoutError:
                return 0
        finally:
            _forget(self._poll_waiters, waiter)

    def close(self, linger: int | None = None) -> None:
        """Close the socket; calls waiting on it raise `SocketClosed`. Idempotent."""
        if self._closed:
            return
        self._closed = True
        loop = self._loop
        for handle in (self._retry, self._again):
            if handle is not None:
                handle.cancel()
        self._retry = self._again = None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._fd)  # before the FD is closed and its number reused
            self._fail_all(SocketClosed())
        self._stash.clear()
        self.socket.close(linger)

    # ---- the machinery -----------------------------------------------------------------------

    def _attach(self) -> asyncio.AbstractEventLoop:
        """Watch the socket's FD on the running loop (once); returns the loop."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._fd = self.socket.getsockopt(zmq.FD)
            loop.add_reader(self._fd, self._serve)
            self._loop = loop
        elif loop is not self._loop:
            raise RuntimeError(
                f"{self!r} is driven by another event loop: a LoopSocket serves the loop that "
                "first waited on it; create one socket per loop"
            )
        return loop

    def _serve(self) -> None:
        """Serve waiting calls while ZMQ can; runs on FD wake-ups and after every operation.

        ZMQ's FD is edge-triggered: any operation (send, receive, reading EVENTS) may consume
        the wake-up of a state that is already there. So while calls wait, this returns only
        after a read of EVENTS that left nothing to do: after that read, any change wakes the
        FD again. (A call that finds nobody waiting reads EVENTS itself before it waits.)
        After ``_SERVE_BUDGET`` messages it returns without that read and serves again in the
        loop's next turn, so that a backlog does not keep the loop from everything else.
        """
        if self._closed:
            return
        blocked: set[bytes | None] = set()  # refused in this call; the retry timer retries
        budget = _SERVE_BUDGET
        try:
            while True:
                events = self.socket.getsockopt(_EVENTS)
                if self._poll_waiters:
                    self._wake_polls(events)
                progress = False
                if (events & _POLLIN or self._stash) and self._recv_waiters:
                    progress = self._recv_one()
                    budget -= 1
                if events & _POLLOUT and self._send_queues:
                    refused = len(blocked)
                    moved = self._send_heads(blocked, budget)
                    # A refusal is progress too: an operation ran, so EVENTS is read again.
                    progress = progress or moved > 0 or len(blocked) > refused
                    budget -= moved
                if not progress:
                    return
                if not (self._recv_waiters or self._send_queues or self._poll_waiters):
                    return  # nobody waits: the next call reads EVENTS itself
                if budget <= 0:
                    if self._again is None and self._loop is not None:
                        self._again = self._loop.call_soon(self._on_again)
                    return
        except zmq.ZMQError as e:  # the context was terminated under us
            self._fail_all(e)

    def _on_again(self) -> None:
        self._again = None
        self._serve()

    def _recv_one(self) -> bool:
        waiters = self._recv_waiters
        while waiters and waiters[0].future.done():  # cancelled
            waiters.popleft()
        if not waiters:
            return False
        w = waiters[0]
        if self._stash:
            waiters.popleft()
            w.future.set_result(_as_copy(self._stash.popleft(), w.copy))
            return True
        try:
            frames = self._recv_now(w.copy)
        except zmq.ZMQError as e:
            waiters.popleft()
            w.future.set_exception(e)
            return True
        if frames is None:
            return False
        waiters.popleft()
        w.future.set_result(frames)
        return True

    def _recv_now(self, copy: bool) -> list[Any] | None:
        """One whole message if one is there, else None."""
        sock = self.socket
        try:
            first = sock.recv(_NOBLOCK, copy=copy)
        except zmq.Again:
            return None
        frames = [first]
        while sock.getsockopt(_RCVMORE):  # the rest of a message is there with its first frame
            frames.append(sock.recv(_NOBLOCK, copy=copy))
        return frames

    def _send_now(self, msg_parts: list[Any], copy: bool, track: bool) -> Any:
        """Queue one message in libzmq, or raise zmq.Again having queued none of it."""
        # libzmq checks the high-water mark at a message's first frame only.
        send = self.socket.send
        for part in msg_parts[:-1]:
            send(part, _SNDMORE_NOBLOCK, copy=copy, track=track)
        return send(msg_parts[-1], _NOBLOCK, copy=copy, track=track)

    def _send_heads(self, blocked: set[bytes | None], budget: int) -> int:
        """Send queued messages, in order per destination, until ZMQ refuses one or ``budget``
        of them are sent. Returns how many were sent or failed; a destination ZMQ refused is
        added to ``blocked``. A destination still queued when the budget ran out goes last in
        the order, so the next call serves the others first."""
        moved = 0
        for key, queue in list(self._send_queues.items()):
            if key in blocked:
                continue
            while queue and moved < budget:
                w = queue[0]
                if w.future.done():  # cancelled
                    queue.popleft()
                    continue
                try:
                    result = self._send_now(w.frames, w.copy, w.track)
                except zmq.Again:
                    # An operation ran, so EVENTS is read again; this destination waits for an
                    # FD wake-up or the retry timer.
                    blocked.add(key)
                    self._arm_retry()
                    break
                except zmq.ZMQError as e:  # EHOSTUNREACH: that peer is gone
                    queue.popleft()
                    w.future.set_exception(e)
                else:
                    queue.popleft()
                    w.future.set_result(result)
                    self._retry_delay = _RETRY_FIRST_S
                moved += 1
            if not queue:
                del self._send_queues[key]
            elif moved >= budget:
                self._send_queues[key] = self._send_queues.pop(key)
                break
        return moved

    def _wake_polls(self, events: int) -> None:
        if self._stash:
            events |= _POLLIN
        for w in self._poll_waiters:
            ready = events & w.flags
            if ready and not w.future.done():
                w.future.set_result(ready)

    def _arm_retry(self) -> None:
        if self._retry is None and self._loop is not None:
            self._retry = self._loop.call_later(self._retry_delay, self._on_retry)
            self._retry_delay = min(self._retry_delay * 2, _RETRY_MAX_S)

    def _on_retry(self) -> None:
        self._retry = None
        self._serve()

    def _fail_all(self, exc: BaseException) -> None:
        waiters = [*self._recv_waiters, *self._poll_waiters]
        for queue in self._send_queues.values():
            waiters += queue
        self._recv_waiters.clear()
        self._send_queues.clear()
        self._poll_waiters.clear()
        for w in waiters:
            if not w.future.done():
                w.future.set_exception(exc)


def _check_frames(msg_parts: list[Any]) -> None:
    """Refuse a message that could not be sent whole (before any frame of it is queued)."""
    if not msg_parts:
        raise ValueError("a message needs at least one frame")
    for i, part in enumerate(msg_parts):
        if not isinstance(part, (bytes, zmq.Frame, memoryview)):
            try:
                memoryview(part)
            except TypeError:
                raise TypeError(
                    f"frame {i} of the message ({type(part).__name__}) is not bytes or a buffer"
                ) from None


def _peer_key(msg_parts: list[Any]) -> bytes:
    """A ROUTER message's destination: its first frame, as bytes."""
    ident = msg_parts[0]
    return ident if isinstance(ident, bytes) else bytes(ident)


def _as_copy(frames: list[Any], copy: bool) -> list[Any]:
    """A stashed message in the form its new receiver asked for (bytes, or zmq.Frame)."""
    if copy:
        return [f if isinstance(f, bytes) else f.bytes for f in frames]
    return [zmq.Frame(f) if isinstance(f, bytes) else f for f in frames]


def _drop_cancelled(waiters: deque[_Waiter], waiter: _Waiter) -> None:
    """Take a cancelled call's waiter (its future done) out of its queue in O(1).

    At either end it is removed; one in the middle stays, done and without its frames, until
    serving reaches it at the head and skips it (`_recv_one`, `_send_heads`). Removing it from
    the middle would cost the queue's length: cancelling n calls queued behind a full peer (a
    run stopped with many requests in flight) would take O(n^2), minutes of a blocked loop.
    """
    if waiters and waiters[0] is waiter:
        waiters.popleft()
    elif waiters and waiters[-1] is waiter:
        waiters.pop()
    else:
        waiter.frames = None
    while waiters and waiters[0].future.done():
        waiters.popleft()


def _forget(waiters: Any, waiter: _Waiter) -> None:
    try:
        waiters.remove(waiter)
    except ValueError:
        pass
