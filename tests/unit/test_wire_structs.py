"""Every wire struct round-trips through msgpack, and a map with an unknown key or a field of the
wrong type is refused with a message naming the struct and the field."""

from __future__ import annotations

import math

import msgpack
import pytest

from arl.engines.spec import EngineSpec
from arl.protocol.node_config import NodeConfig
from arl.protocol.remote import LoadedBatch, StatsError, StepStats
from arl.protocol.report import GroupReport, RejectedGroup
from arl.protocol.rtensor import RTensor, ShardRef
from arl.protocol.shards import ShardMeta, TensorSlot
from arl.protocol.wire import WireStruct, WireStructError
from arl.weights.buckets import BucketLayout

META = ShardMeta("g1", 96, 12, {"x": [2, 6]}, {"x": "float32"})
REF = ShardRef("n0", "g1", 96, 12, {"x": [2, 6]}, {"x": "float32"}, 2)
SLOT = TensorSlot("x", "float32", (2, 6), 64, 48)

EXAMPLES: dict[type, WireStruct] = {
    ShardMeta: META,
    TensorSlot: SLOT,
    ShardRef: REF,
    RTensor: RTensor([REF, REF], peers={"n0": "tcp://127.0.0.1:5555"}),
    NodeConfig: NodeConfig(allowed_import_prefixes=("arl.", "mine.")),
    GroupReport: GroupReport(
        key="g1",
        meta=META.to_wire(),
        group_size=2,
        rewards=[0.0, 1.0],
        n_gen_tokens=8,
        min_version=3,
        max_version=4,
        seconds=1.5,
        data_id="d",
    ),
    RejectedGroup: RejectedGroup("g2", "no answer", 1, 0.5, "d"),
    LoadedBatch: LoadedBatch(4, 40),
    StepStats: StepStats({"loss": 0.5, "grad_norm": math.inf}),
    EngineSpec: EngineSpec(name="sglang", model_path="/m", server_args=("--x", "1")),
    BucketLayout: BucketLayout((SLOT, TensorSlot("y", "bfloat16", (3,), 128, 6)), 256),
}


def _all_structs(cls: type = WireStruct) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_structs(sub)
    return out


def _through_msgpack(value):
    return msgpack.unpackb(msgpack.packb(value))


def test_every_wire_struct_has_an_example_here():
    assert _all_structs() <= set(EXAMPLES), "add the new wire struct to EXAMPLES"


@pytest.mark.parametrize("cls", EXAMPLES, ids=lambda c: c.__name__)
def test_a_wire_struct_round_trips_through_msgpack(cls):
    obj = EXAMPLES[cls]
    wire = obj.to_wire()
    assert _through_msgpack(wire) == wire  # plain values only: lists, maps, numbers, text
    assert cls.from_wire(_through_msgpack(wire)) == obj


def _map_fields(cls) -> list[str]:
    wire = EXAMPLES[cls].to_wire()
    tag = cls.wire_tag[0] if cls.wire_tag else None
    return [k for k in wire if k != tag]


MAP_STRUCTS = [c for c in EXAMPLES if not c.wire_as_list and c is not StepStats]


@pytest.mark.parametrize("cls", MAP_STRUCTS, ids=lambda c: c.__name__)
def test_an_unknown_key_is_refused_naming_it(cls):
    with pytest.raises(WireStructError) as info:
        cls.from_wire({**EXAMPLES[cls].to_wire(), "bogus": 1})
    assert isinstance(info.value, cls.wire_error)
    assert f"{cls.__name__}: has unknown field(s) ['bogus']" in str(info.value)


@pytest.mark.parametrize(
    ("cls", "field"),
    [(c, f) for c in MAP_STRUCTS for f in _map_fields(c)],
    ids=lambda v: getattr(v, "__name__", v),
)
def test_a_wrong_typed_field_is_refused_naming_it(cls, field):
    with pytest.raises(WireStructError) as info:
        cls.from_wire({**EXAMPLES[cls].to_wire(), field: b"?"})
    assert f"{cls.__name__}: '{field}' must be " in str(info.value)
    assert "got b'?'" in str(info.value)


@pytest.mark.parametrize("cls", MAP_STRUCTS, ids=lambda c: c.__name__)
def test_a_missing_field_is_refused_unless_optional(cls):
    required = [f for f in _map_fields(cls) if f not in cls.wire_optional]
    for field in required:
        wire = {k: v for k, v in EXAMPLES[cls].to_wire().items() if k != field}
        with pytest.raises(WireStructError, match=f"{cls.__name__}: '{field}' must be .* missing"):
            cls.from_wire(wire)


def test_nested_errors_name_the_path():
    wire = EXAMPLES[RTensor].to_wire()
    wire["refs"][1]["shapes"]["x"][0] = "2"
    with pytest.raises(WireStructError, match=r"RTensor: 'refs\[1\].shapes\[x\]\[0\]' must be an"):
        RTensor.from_wire(wire)


def test_a_tensor_slot_travels_as_a_list_and_is_checked():
    assert SLOT.to_wire() == ["x", "float32", [2, 6], 64, 48]
    with pytest.raises(WireStructError, match=r"a list \[name, dtype, shape, offset, nbytes\]"):
        TensorSlot.from_wire([*SLOT.to_wire(), 0])
    with pytest.raises(WireStructError, match="TensorSlot: 'shape' must be a list of integers"):
        TensorSlot.from_wire(["x", "float32", "26", 64, 48])
    with pytest.raises(WireStructError, match="48 bytes do not hold a float32 tensor of shape"):
        TensorSlot.from_wire(["x", "float32", [2, 5], 64, 48])


def test_step_stats_travel_as_a_flat_map_with_nan_as_text():
    wire = StepStats({"loss": math.nan}).to_wire()
    assert wire == {"loss": "nan"}
    assert math.isnan(StepStats.from_wire(wire)["loss"])
    with pytest.raises(StatsError, match="StepStats: 'loss' must be a number, got b'?'"):
        StepStats.from_wire({"loss": b"?"})


def test_wire_forms_keep_their_keys_in_order():
    """The bytes a node and a controller exchange did not change with the declared structs."""
    assert list(REF.to_wire()) == [
        "node",
        "key",
        "nbytes",
        "n_tokens",
        "shapes",
        "dtypes",
        "group_size",
    ]
    assert list(EXAMPLES[RTensor].to_wire()) == ["__rtensor__", "refs", "layout", "peers"]
    assert list(EXAMPLES[RejectedGroup].to_wire())[:2] == ["rejected", "key"]
