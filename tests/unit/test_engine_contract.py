"""Every registered engine class implements the whole `Engine` protocol, as declared."""

from __future__ import annotations

import inspect

import pytest

from arl.engines.base import Engine, WeightCheck, WeightTarget, WeightTargetError
from arl.engines.hf import HFEngine
from arl.engines.spec import ENGINES, engine_class

DATA_MEMBERS = (
    *("name", "weight_targets", "pause_in_place", "can_sleep", "serves_lora", "weight_check"),
    "version",
)


def protocol_methods() -> dict[str, object]:
    """The protocol's methods and properties by name (its data members are `DATA_MEMBERS`)."""
    return {
        n: v
        for n, v in vars(Engine).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, (property, classmethod)))
    }


def _function(member: object) -> object:
    return member.__func__ if isinstance(member, classmethod) else member


def contract_gaps(cls: type) -> list[str]:
    """What ``cls`` lacks of the protocol, or gets wrong (a sync method for an async one)."""
    gaps = []
    annotated = {n for k in cls.__mro__ for n in vars(k).get("__annotations__", {})}
    for n in DATA_MEMBERS:
        if n not in annotated and not hasattr(cls, n):
            gaps.append(f"{n}: missing")
    for n, member in protocol_methods().items():
        got = inspect.getattr_static(cls, n, None)
        if got is None and n not in annotated:
            gaps.append(f"{n}: missing")
        elif not isinstance(member, property):
            member, got = _function(member), _function(got)
            if not callable(got):
                gaps.append(f"{n}: not a method")
            elif inspect.iscoroutinefunction(member) != inspect.iscoroutinefunction(got):
                want = "async" if inspect.iscoroutinefunction(member) else "sync"
                gaps.append(f"{n}: must be {want}")
    return gaps


def test_the_protocol_lists_the_whole_contract() -> None:
    names = set(protocol_methods()) | set(DATA_MEMBERS)
    assert names == {
        *("name", "weight_targets", "pause_in_place", "version", "start", "aclose"),
        *("wait_failed", "agenerate"),
        *("pause", "resume", "set_version", "health", "weights_device", "update_weights"),
        *("update_weights_from_disk", "weights_checksum", "score", "from_spec"),
        *("can_sleep", "serves_lora", "sleep", "wake", "weight_check"),
    }


@pytest.mark.parametrize("name", sorted(ENGINES))
def test_every_registered_engine_implements_the_contract(name: str) -> None:
    cls = engine_class(name)
    assert contract_gaps(cls) == []
    assert cls.name == name
    assert cls.weight_targets and all(isinstance(t, WeightTarget) for t in cls.weight_targets)
    assert isinstance(cls.pause_in_place, bool)
    assert isinstance(cls.can_sleep, bool) and isinstance(cls.serves_lora, bool)
    assert isinstance(cls.weight_check, WeightCheck)
    drop = inspect.signature(cls.sleep).parameters.get("drop_weights")
    assert drop is not None and drop.default is False
    # Callers pass the mode to every engine; one that cannot keep requests aborts them.
    in_place = inspect.signature(cls.pause).parameters.get("in_place")
    assert in_place is not None and in_place.default is False


CLASS_MEMBERS = (
    *("name", "weight_targets", "pause_in_place", "can_sleep", "serves_lora", "weight_check"),
)


@pytest.mark.parametrize("member", [*sorted(protocol_methods()), *CLASS_MEMBERS[1:]])
def test_an_engine_lacking_a_member_is_caught(member: str) -> None:
    """The check above would fail for an engine without any one member."""
    attrs = {n: getattr(HFEngine, n) for n in [*protocol_methods(), *CLASS_MEMBERS]}
    del attrs[member]
    lacking = type("Lacking", (), {"__annotations__": {"version": int}, **attrs})
    assert contract_gaps(lacking) == [f"{member}: missing"]


def test_a_sync_method_where_the_contract_is_async_is_caught() -> None:
    class SyncClose(HFEngine):
        def aclose(self) -> None:  # type: ignore[override]
            self.close()

    assert contract_gaps(SyncClose) == ["aclose: must be async"]


def test_declared_weight_targets() -> None:
    assert engine_class("hf").weight_targets == {WeightTarget.TENSORS, WeightTarget.DIRECTORY}
    assert engine_class("vllm").weight_targets == {WeightTarget.DIRECTORY}
    assert engine_class("sglang").weight_targets == {WeightTarget.DIRECTORY}


def test_declared_weight_checks() -> None:
    """hf checksums its weights; a server has none to checksum and scores the probe."""
    assert engine_class("hf").weight_check is WeightCheck.CHECKSUM
    assert engine_class("vllm").weight_check is WeightCheck.PROBE
    assert engine_class("sglang").weight_check is WeightCheck.PROBE


def test_only_the_hf_engine_keeps_requests_in_place_across_a_pause() -> None:
    assert engine_class("hf").pause_in_place is True
    assert engine_class("vllm").pause_in_place is False
    assert engine_class("sglang").pause_in_place is False


def test_an_undeclared_target_is_refused_naming_what_the_engine_accepts() -> None:
    engine = engine_class("sglang")("/nonexistent/model")  # built, not started: no process
    with pytest.raises(WeightTargetError, match=r"does not take weights as tensors") as err:
        engine.update_weights([])
    assert "sglang engine" in str(err.value) and "it accepts: directory" in str(err.value)
