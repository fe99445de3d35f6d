"""Messages on the wire: a msgpack header plus zero-copy tensor frames (DESIGN §2).

A payload is any msgpack value in which torch tensors may appear anywhere. ``pack`` returns
``[header, frame1, ...]``: the header is msgpack of the value with each tensor replaced by an
ExtType that names its dtype, shape and frame index; each frame is the tensor's own bytes (no
copy for contiguous CPU tensors). Tensors smaller than ``inline_threshold`` bytes travel inside
the header. ``unpack`` rebuilds tensors with ``torch.frombuffer`` over the received frames (no
copy). Nothing is ever pickled.

torch is imported at the first tensor received, not with this module (the launcher imports the
wire before its nodes start): until torch is imported, no payload can hold a tensor.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs
import msgpack

from arl.protocol.dtypes import dtype_of, wire_names
from arl.protocol.errors import ErrorKind

if TYPE_CHECKING:
    import torch

PROTOCOL_VERSION = 1
OPS = frozenset({"call", "ok", "err", "event", "hello", "hb", "bye"})

_EXT_FRAME = 1  # tensor whose bytes are a separate frame
_EXT_INLINE = 2  # small tensor whose bytes sit in the header

# A declared shape above this many elements is refused before anything is allocated.
MAX_ELEMENTS = 1 << 40


# Received frames are read-only; tensors built over them are views that arl never writes into.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


class WireError(ValueError):
    """A message that does not follow the arl wire format."""

    error_kind = ErrorKind.MALFORMED


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; raises WireError for dtypes the wire does not carry."""
    try:
        return wire_names()[dtype]
    except KeyError:
        raise WireError(f"dtype {dtype} cannot travel on the wire; cast it first") from None


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype for a wire dtype name."""
    try:
        return dtype_of(name)
    except ValueError:
        raise WireError(f"unknown dtype {name!r} on the wire") from None


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of ``t`` (staged to CPU and made contiguous once when needed)."""
    if t.device.type != "cpu":
        t = t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    # uint8 view shares storage, so the memoryview keeps the bytes alive with no copy.
    return memoryview(t.reshape(-1).view(sys.modules["torch"].uint8).numpy())


def pack(obj: Any, inline_threshold: int = 256) -> list[Any]:
    """Encode ``obj`` into ``[header, *tensor_frames]`` (see module docstring)."""
    frames: list[Any] = [b""]

    def default(o: Any) -> Any:
        torch_module = sys.modules.get("torch")  # without torch imported, o is no tensor
        if torch_module is not None and isinstance(o, torch_module.Tensor):
            buf = _tensor_bytes(o.detach())
            meta = [dtype_name(o.dtype), list(o.shape)]
            if buf.nbytes <= inline_threshold:
                return msgpack.ExtType(_EXT_INLINE, msgpack.packb([*meta, buf.tobytes()]))
            frames.append(buf)
            return msgpack.ExtType(_EXT_FRAME, msgpack.packb([*meta, len(frames) - 1]))
        if isinstance(o, (tuple, set, frozenset)):
            return list(o)
        raise TypeError(
            f"cannot send {type(o).__name__} on the wire (plain values and tensors only)"
        )

    frames[0] = msgpack.packb(obj, default=default, use_bin_type=True)
    return frames


def _as_buffer(frame: Any) -> memoryview:
    if hasattr(frame, "buffer"):  # zmq.Frame
        return frame.buffer
    return memoryview(frame)


def _make_tensor(dtype: torch.dtype, shape: list[int], buf: memoryview) -> torch.Tensor:
    import torch

    n = 1
    for s in shape:
        n *= s
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
    return t.view(shape)


def _check_meta(dtype_s: Any, shape: Any) -> tuple[torch.dtype, list[int], int]:
    dtype = parse_dtype(dtype_s)
    if not isinstance(shape, list) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        raise WireError(f"tensor shape must be a list of non-negative ints, got {shape!r}")
    n = 1
    for s in shape:
        n *= s
        # Each dim is bounded too: [0, 2**63] has no elements, but torch.empty cannot take that
        # shape, so it must be refused here as a WireError rather than fail there.
        if n > MAX_ELEMENTS or s > MAX_ELEMENTS:
            raise WireError(f"declared tensor shape {shape} is too large")
    return dtype, shape, n * dtype.itemsize


def unpack(frames: Sequence[Any]) -> Any:
    """Decode ``[header, *frames]`` produced by :func:`pack`; raises WireError when malformed."""
    if not frames:
        raise WireError("empty message")
    bufs = [_as_buffer(f) for f in frames]
    used: set[int] = set()

    def ext_hook(code: int, data: bytes) -> Any:
        if code not in (_EXT_FRAME, _EXT_INLINE):  # checked first, so the error names the code
            raise WireError(f"unknown ext type {code}")
        try:
            meta = msgpack.unpackb(data)
        except Exception as e:
            raise WireError(f"bad tensor descriptor: {e}") from None
        if not isinstance(meta, list) or len(meta) != 3:
            raise WireError(f"tensor descriptor must be [dtype, shape, data], got {meta!r}")
        dtype, shape, nbytes = _check_meta(meta[0], meta[1])
        if code == _EXT_INLINE:
            raw = meta[2]
            if not isinstance(raw, bytes) or len(raw) != nbytes:
                raise WireError(f"inline tensor {shape} {meta[0]} needs {nbytes} bytes")
            return _make_tensor(dtype, shape, memoryview(bytearray(raw)))
        if code == _EXT_FRAME:
            idx = meta[2]
            if not isinstance(idx, int) or not 1 <= idx < len(bufs) or idx in used:
                raise WireError(f"tensor refers to frame {idx!r}, message has {len(bufs)} frames")
            used.add(idx)
            if bufs[idx].nbytes != nbytes:
                raise WireError(
                    f"frame {idx} has {bufs[idx].nbytes} bytes but tensor {shape} {meta[0]} "
                    f"needs {nbytes}"
                )
            return _make_tensor(dtype, shape, bufs[idx])
        raise WireError(f"unknown ext type {code}")

    try:
        obj = msgpack.unpackb(bufs[0], ext_hook=ext_hook, raw=False, strict_map_key=False)
    except WireError:
        raise
    except Exception as e:  # msgpack raises several types for truncated/garbage input
        raise WireError(f"bad msgpack header: {type(e).__name__}: {e}") from None
    if len(used) != len(bufs) - 1:
        raise WireError(f"message has {len(bufs) - 1} tensor frames but uses {len(used)}")
    return obj


@attrs.define
class Message:
    """One control- or data-plane message: ``op`` with request ``id``, ``method`` and ``args``."""

    op: str
    id: int = 0
    method: str = ""
    args: Any = None

    def __attrs_post_init__(self) -> None:
        if self.op not in OPS:
            raise WireError(f"unknown op {self.op!r}; expected one of {sorted(OPS)}")


def encode_message(msg: Message, inline_threshold: int = 256) -> list[Any]:
    """Frames for ``msg``: header map ``{v, id, op, m, a}`` plus tensor frames."""
    return pack(
        {"v": PROTOCOL_VERSION, "id": msg.id, "op": msg.op, "m": msg.method, "a": msg.args},
        inline_threshold,
    )


def decode_message(frames: Sequence[Any]) -> Message:
    """Parse frames into a Message; raises WireError naming what is wrong."""
    head = unpack(frames)
    if not isinstance(head, dict):
        raise WireError(f"header must be a map, got {type(head).__name__}")
    if head.get("v") != PROTOCOL_VERSION:
        raise WireError(f"protocol version {head.get('v')!r}, this side speaks {PROTOCOL_VERSION}")
    op, mid, method = head.get("op"), head.get("id", 0), head.get("m", "")
    if not isinstance(mid, int) or not isinstance(method, str) or not isinstance(op, str):
        raise WireError("header fields id (int), op (str) and m (str) have wrong types")
    return Message(op=op, id=mid, method=method, args=head.get("a"))


def check_message_size(frames: Sequence[Any], max_bytes: int) -> None:
    """Raise WireError when the frames together exceed ``max_bytes`` (no limit when <= 0).

    ZMQ_MAXMSGSIZE bounds each frame alone; this bounds the whole multipart message.
    """
    if max_bytes <= 0:
        return
    total = sum(_as_buffer(f).nbytes for f in frames)
    if total > max_bytes:
        raise WireError(
            f"message of {total} bytes exceeds max_message_bytes={max_bytes}; "
            f"send it in smaller parts or raise the limit"
        )


def peek_id(frames: Sequence[Any]) -> int | None:
    """Best-effort request id of a (possibly malformed) message, so an `err` can answer it."""
    try:
        head = msgpack.unpackb(_as_buffer(frames[0]), raw=False, ext_hook=lambda c, d: None)
        mid = head.get("id") if isinstance(head, dict) else None
        return mid if isinstance(mid, int) else None
    except Exception:
        return None
