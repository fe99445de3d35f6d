"""The weight-sync registry: ``auto`` resolved once, at placement, and kept on the plan; forced
modes refused with a message before any node starts; the trainer and the placement naming no
mode."""

import ast
from pathlib import Path

import pytest

import arl
from arl.config import Config, ConfigError, apply_overrides
from arl.control.placement import plan_placement
from arl.weights import MODES, SyncContext, WeightSync, check_plan, make_weight_sync, sync_class


def _plan(rollout: str, train: str, n_gpus: int, *more: str):
    cfg = apply_overrides(Config(), [f"rollout.backend={rollout}", f"actor.backend={train}", *more])
    return plan_placement(cfg, n_gpus)


@pytest.mark.parametrize(
    ("rollout", "train", "n_gpus", "want"),
    [
        ("hf:d1", "fsdp:d1", 0, "zmq"),  # CPU
        ("hf:d2", "fsdp:d2", 0, "zmq"),
        ("hf:d1", "fsdp:d1", 1, "ipc_buffer"),  # one GPU shared by engine and trainer
        ("hf:d1", "fsdp:d2", 2, "ipc_buffer"),  # colocated: the engine on rank 0's GPU
        ("hf:d1", "fsdp:d1", 2, "nccl"),  # separate GPUs
        ("hf:d2", "fsdp:d4", 8, "nccl"),
        ("hf:d2", "fsdp:d2", 2, "zmq"),  # colocated, one engine away from rank 0's GPU
        ("sglang:d1", "fsdp:d1", 2, "disk"),  # server engines reload from disk
        ("vllm:d1", "fsdp:d1", 0, "disk"),
    ],
)
def test_auto_picks_the_fastest_mode_the_plan_supports(rollout, train, n_gpus, want):
    plan = _plan(rollout, train, n_gpus)
    assert plan.sync_mode == want
    assert check_plan("auto", plan.nodes) == want  # the rule the planner applied


@pytest.mark.parametrize(
    ("mode", "rollout", "n_gpus", "message"),
    [
        ("ipc_buffer", "vllm:d1", 0, "vllm accepts only directory: its weight_targets"),
        ("ipc_buffer", "hf:d1", 2, "use weight_sync.mode=nccl for engines on other GPUs"),
        ("ipc_buffer", "sglang:d1", 1, "sglang accepts only directory: its weight_targets"),
        ("ipc", "hf:d1", 0, "ipc needs GPUs"),
        ("nccl", "hf:d1", 1, "use weight_sync.mode=ipc_buffer"),
        ("nccl", "sglang:d1", 2, "sglang accepts only directory: its weight_targets"),
        ("zmq", "vllm:d1", 0, "use weight_sync.mode=disk"),
    ],
)
def test_a_forced_mode_the_plan_cannot_run_is_refused_at_placement(mode, rollout, n_gpus, message):
    with pytest.raises(ConfigError, match=message):
        _plan(rollout, "fsdp:d1", n_gpus, f"weight_sync.mode={mode}")


def test_forced_modes_that_fit_are_kept():
    def placed(rollout: str, n_gpus: int, mode: str) -> str:
        return _plan(rollout, "fsdp:d1", n_gpus, f"weight_sync.mode={mode}").sync_mode

    assert placed("hf:d1", 0, "nccl") == "nccl"  # gloo stand-in on CPU
    assert placed("hf:d2", 0, "ipc_buffer") == "ipc_buffer"  # shm file
    assert placed("hf:d1", 1, "ipc") == "ipc"
    assert placed("hf:d1", 1, "zmq") == "zmq"
    assert placed("hf:d1", 1, "disk") == "disk"


def test_registry_names_match_their_classes_and_unknown_names_are_refused():
    for name in MODES:
        cls = sync_class(name)
        assert issubclass(cls, WeightSync) and cls.mode == name
    with pytest.raises(ConfigError, match="did you mean 'nccl'"):
        sync_class("ncll")


def test_make_weight_sync_builds_the_mode_the_plan_resolved():
    ctx = SyncContext(
        cluster=None,
        train=[],
        rollout_workers=[],
        rollout=None,
        config=Config().weight_sync,
        run_path=Path("."),
        free=None,
    )
    sync = make_weight_sync(_plan("hf:d1", "fsdp:d1", 1), ctx)
    assert type(sync).mode == "ipc_buffer" and sync.ctx is ctx


def _string_constants(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    consts = (n for n in ast.walk(tree) if isinstance(n, ast.Constant))
    return {n.value for n in consts if isinstance(n.value, str)}


def test_the_trainer_and_the_placement_name_no_mode():
    root = Path(arl.__file__).parent
    for rel in (
        "trainer.py",
        "run_dir.py",
        "control/workers.py",
        "control/placement.py",
        "control/cluster.py",
    ):
        named = _string_constants(root / rel) & set(MODES)
        assert not named, f"{rel} names weight-sync modes {named}: use the arl.weights registry"


def test_each_mode_has_one_plan_rule_its_controller_half_inherits():
    """The launcher decides the mode from `arl.weights.rules` without importing the modes."""
    from arl.weights import RULES

    assert set(RULES) == set(MODES)
    for mode, rule in RULES.items():
        cls = sync_class(mode)
        assert issubclass(cls, rule) and cls.mode == rule.mode == mode
        assert cls.check_plan.__func__ is rule.check_plan.__func__


def test_each_engine_declares_its_traits_where_the_launcher_reads_them():
    from arl.engines.spec import ENGINES, TRAITS, engine_class

    assert set(TRAITS) == set(ENGINES)
    for name, traits in TRAITS.items():
        cls = engine_class(name)
        for field in ("weight_targets", "pause_in_place", "can_sleep", "serves_lora"):
            assert getattr(cls, field) == getattr(traits, field), (name, field)
        assert cls.weight_check is traits.weight_check
