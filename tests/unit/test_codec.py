"""The wire codec alone (DESIGN §2): msgpack header plus zero-copy tensor frames."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

from arl.protocol.dtypes import torch_dtypes
from arl.wire import codec
from arl.wire.codec import (
    PROTOCOL_VERSION,
    Message,
    WireError,
    decode_message,
    encode_message,
    pack,
    peek_id,
    unpack,
)

ALL_DTYPES = list(torch_dtypes().values())
SHAPES = [(), (0,), (1,), (7,), (3, 0, 2), (4, 33), (2, 3, 4, 5), (300,)]


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bit patterns (NaNs, infs, subnormals included) viewed as ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _address(buf: object) -> int:
    """Address of the first byte of a buffer (bytes, bytearray, memoryview)."""
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


def _header(**fields: object) -> bytes:
    head = {"v": PROTOCOL_VERSION, "id": 7, "op": "call", "m": "ping", "a": None}
    head.update(fields)
    return msgpack.packb(head, use_bin_type=True)


def _frame_ref(dtype: str, shape: list, index: object) -> msgpack.ExtType:
    return msgpack.ExtType(codec._EXT_FRAME, msgpack.packb([dtype, shape, index]))


# ---- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_round_trips_bit_exact(dtype):
    for i, shape in enumerate(SHAPES):
        t = _random(dtype, shape, seed=i)
        back = unpack(pack({"t": t}))["t"]
        assert back.dtype == dtype, (dtype, shape)
        assert tuple(back.shape) == shape
        assert _bits(back) == _bits(t), (dtype, shape)


def test_bfloat16_travels_as_bfloat16_not_upcast():
    t = _random(torch.bfloat16, (1000,))
    frames = pack(t)
    assert len(frames) == 2
    assert memoryview(frames[1]).nbytes == 2000  # two bytes per element, not four
    assert unpack(frames).dtype == torch.bfloat16


def test_zero_dim_and_empty_tensors_keep_shape_and_dtype():
    scalar = torch.tensor(3.5, dtype=torch.float64)
    back = unpack(pack(scalar))
    assert back.dim() == 0 and back.dtype == torch.float64 and back.item() == 3.5
    for shape in [(0,), (3, 0), (0, 5, 7), (100000, 0)]:
        empty = torch.empty(shape, dtype=torch.int32)
        frames = pack(empty)
        assert len(frames) == 1  # no bytes, so nothing worth a frame
        back = unpack(frames)
        assert tuple(back.shape) == shape and back.dtype == torch.int32


def test_non_contiguous_inputs_arrive_as_their_logical_values():
    base = torch.arange(2000, dtype=torch.float32).reshape(40, 50)
    views = {
        "transposed": base.t(),
        "strided": base[:, ::3],
        "expanded": torch.arange(100, dtype=torch.float32).expand(30, 100),
        "narrowed": base[5:9, 10:40],
    }
    for name, view in views.items():
        assert not view.is_contiguous(), name
        for threshold in (0, 1 << 30):  # through a frame, and inline
            back = unpack(pack(view, inline_threshold=threshold))
            assert back.is_contiguous()
            assert torch.equal(back, view), name


def test_nested_structures_round_trip():
    a = torch.randn(16, 16)
    b = torch.tensor([1, -2, 3])
    value = {
        "name": "batch",
        "blob": b"\x00\xffraw",
        "none": None,
        "flags": [True, False],
        "numbers": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 1.5],
        "tensors": [a, {"inner": (a, b)}, [[b]]],
        7: "int key",
    }
    frames = pack(value)
    assert len(frames) == 3  # one frame per large tensor occurrence; b is inline
    back = unpack(frames)
    assert back["name"] == "batch" and back["blob"] == b"\x00\xffraw" and back["none"] is None
    assert back["flags"] == [True, False]
    assert back["numbers"] == value["numbers"]
    assert back[7] == "int key"
    assert torch.equal(back["tensors"][0], a)
    assert torch.equal(back["tensors"][1]["inner"][0], a)  # tuples arrive as lists
    assert torch.equal(back["tensors"][1]["inner"][1], b)
    assert torch.equal(back["tensors"][2][0][0], b)


def test_message_round_trip_keeps_every_field():
    t = torch.randn(64, 8).half()
    msg = Message("call", 123456789, "call", {"obj": "e", "args": [t]})
    out = decode_message(encode_message(msg))
    assert (out.op, out.id, out.method) == ("call", 123456789, "call")
    assert torch.equal(out.args["args"][0], t)


# ---- inline threshold and zero copy --------------------------------------------------------


def test_inline_threshold_is_respected():
    at = torch.zeros(64, dtype=torch.float32)  # 256 bytes
    over = torch.zeros(65, dtype=torch.float32)  # 260 bytes
    assert len(pack(at)) == 1
    assert len(pack(over)) == 2
    assert len(pack(at, inline_threshold=255)) == 2
    assert len(pack(over, inline_threshold=1024)) == 1
    assert len(encode_message(Message("ok", 1, "x", [at, over]))) == 2
    # The inline one is really in the header: the header grows by its bytes.
    assert len(pack(at)[0]) > 256 > len(pack(over)[0])


def test_frame_is_zero_copy_on_send_and_receive():
    t = torch.arange(1 << 16, dtype=torch.float32)
    frames = pack({"t": t})
    frame = frames[1]
    assert _address(frame) == t.data_ptr()  # the frame is the tensor's memory
    t[0] = 42.0
    assert memoryview(frame).cast("f")[0] == 42.0
    # On receipt the tensor is a view over the frame: no copy either.
    received = bytearray(memoryview(frame))
    back = unpack([frames[0], received])["t"]
    assert back.data_ptr() == _address(received)
    assert back[0].item() == 42.0


# ---- malformed input -----------------------------------------------------------------------


def _wire_error(frames: list) -> str:
    with pytest.raises(WireError) as info:
        decode_message(frames)
    return str(info.value)


def test_frame_size_disagreeing_with_dtype_and_shape_is_refused():
    head = _header(a=_frame_ref("float32", [10], 1))
    msg = _wire_error([head, b"\0" * 39])
    assert "frame 1 has 39 bytes" in msg and "needs 40" in msg
    assert "needs 40" in _wire_error([_header(a=_frame_ref("float32", [10], 1)), b"\0" * 41])


def test_missing_and_extra_frames_are_refused():
    t = torch.zeros(1000)
    frames = encode_message(Message("call", 1, "x", t))
    assert "refers to frame 1, message has 1 frames" in _wire_error(frames[:1])
    assert "2 tensor frames but uses 1" in _wire_error([*frames, b"extra"])
    assert "refers to frame 5" in _wire_error([_header(a=_frame_ref("float32", [1], 5)), b"xxxx"])
    # Two tensors may not share one frame.
    two = _header(a=[_frame_ref("float32", [1], 1), _frame_ref("float32", [1], 1)])
    assert "frame 1" in _wire_error([two, b"\0" * 4])


def test_wrong_protocol_version_and_unknown_op_are_refused():
    assert "protocol version 2" in _wire_error([_header(v=2)])
    assert "protocol version None" in _wire_error([msgpack.packb({"id": 1, "op": "call"})])
    msg = _wire_error([_header(op="frobnicate")])
    assert "unknown op 'frobnicate'" in msg and "call" in msg


def test_wrong_field_types_are_refused():
    assert "header must be a map" in _wire_error([msgpack.packb([1, 2, 3])])
    for field, value in [("id", "seven"), ("op", 3), ("m", [1])]:
        assert "wrong types" in _wire_error([_header(**{field: value})]), field


def test_huge_declared_shapes_are_refused_before_allocation():
    for shape in ([1 << 30, 1 << 30, 1 << 30], [1 << 62], [0, 1 << 63], [1 << 63, 0]):
        head = _header(a=_frame_ref("float32", shape, 1))
        msg = _wire_error([head, b"\0" * 4])
        assert "too large" in msg, (shape, msg)
    inline = msgpack.ExtType(codec._EXT_INLINE, msgpack.packb(["int8", [1 << 50], b""]))
    assert "too large" in _wire_error([_header(a=inline)])
    inline = msgpack.ExtType(codec._EXT_INLINE, msgpack.packb(["int8", [1 << 30], b"ab"]))
    assert "needs 1073741824 bytes" in _wire_error([_header(a=inline)])


def test_bad_tensor_descriptors_are_refused():
    assert "unknown dtype 'float128'" in _wire_error([_header(a=_frame_ref("float128", [1], 1))])
    assert "non-negative ints" in _wire_error([_header(a=_frame_ref("float32", [-1], 1))])
    assert "non-negative ints" in _wire_error([_header(a=_frame_ref("float32", "big", 1))])
    bad_meta = msgpack.ExtType(codec._EXT_FRAME, msgpack.packb({"dtype": "float32"}))
    assert "tensor descriptor" in _wire_error([_header(a=bad_meta)])
    assert "unknown ext type 9" in _wire_error([_header(a=msgpack.ExtType(9, b""))])


def test_truncated_msgpack_is_refused_at_every_cut():
    head = encode_message(Message("call", 99, "call", {"obj": "x", "args": ["a" * 20, 1.5]}))[0]
    for cut in range(len(head)):
        msg = _wire_error([head[:cut]])
        assert "bad msgpack header" in msg or "empty" in msg, (cut, msg)
    assert "empty message" in _wire_error([])
    assert "bad msgpack header" in _wire_error([head + b"\x00"])  # trailing garbage


def test_deeply_nested_header_is_refused_not_a_crash():
    assert "bad msgpack header" in _wire_error([b"\x91" * 100_000 + b"\xc0"])


def test_peek_id_reads_the_id_of_a_malformed_message_when_it_can():
    assert peek_id([_header(id=31, a=_frame_ref("float32", [10], 1))]) == 31
    assert peek_id([_header(id=31, v=9)]) == 31
    assert peek_id([_header(id="x")]) is None
    assert peek_id([b"\xc1garbage"]) is None
    assert peek_id([msgpack.packb([1, 2])]) is None


def test_non_encodable_objects_raise_type_error_naming_the_type():
    class Widget:
        pass

    for value, name in [
        (object(), "object"),
        ({"deep": [1, {"x": Widget()}]}, "Widget"),
        ([lambda: 0], "function"),
        ({"c": 1j}, "complex"),
    ]:
        with pytest.raises(TypeError) as info:
            pack(value)
        assert name in str(info.value)
    with pytest.raises(WireError, match="cast it first"):
        pack(torch.zeros(4).to(torch.complex32))
