"""Weight sync modes end to end on CPU, and the bucket helpers they share (DESIGN §6).

``nccl`` runs its broadcast group on gloo here: the same code path as NCCL on GPUs, with two
rollout replicas so the broadcast has more than one receiver. ``ipc_buffer`` shares a
shared-memory file where a GPU shares a CUDA buffer. ``disk`` runs as the fallback.
After every step each engine must hold exactly the trainer's weights (checksum).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from pathlib import Path

import pytest
import torch

from arl.config import Config, ConfigError, apply_overrides
from arl.control.placement import plan_placement
from arl.run import run
from arl.stats.logger import read_jsonl
from arl.weights.buckets import (
    ALIGN,
    BroadcastGroup,
    BucketLayout,
    WeightTransferError,
    broadcast_buckets,
    flatten_bucket,
    iter_buckets,
    new_bucket_buffer,
    plan_buckets,
    receive_buckets,
    unflatten_bucket,
)
from arl.weights.ipc_buffer import SHM_DIR
from tests.support.tiny_model import make_tiny_model, tiny_run_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _assert_synced_every_step(cfg: Config) -> list[dict]:
    rows = read_jsonl(cfg.run_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["sync/checksum_match"] is True, r
        assert r["version"] == r["step"]
        assert r["sync/paused_s"] > 0
    # The weights moved each step, and each step's engines followed.
    assert len({r["sync/checksum"] for r in rows}) == 3
    return rows


def test_nccl_mode_on_gloo_two_engines_match_trainer_every_step(tmp_path, tiny_model):
    # A small bucket size splits the tiny model (~3.4 MB) into many buckets, one in flight.
    cfg = tiny_run_config(
        tmp_path,
        tiny_model,
        "weight_sync.mode=nccl",
        "weight_sync.bucket_bytes=262144",
        "rollout.backend=hf:d2",
    )
    asyncio.run(run(cfg))
    rows = _assert_synced_every_step(cfg)
    for r in rows:
        assert r["sync/buckets"] > 1
        assert r["sync/bytes"] > 0


def _weight_files() -> set[str]:
    return {f.name for f in Path(SHM_DIR).glob("arl-weights-*")}


def test_ipc_buffer_on_cpu_two_engines_two_ranks_match_trainer_every_step(tmp_path, tiny_model):
    # The CPU twin of the CUDA buffer: one shared-memory file, mapped once by both engines;
    # per sync rank 0 fills it from the gathered weights (two ranks) and each engine copies out.
    before = _weight_files()
    overrides = ("weight_sync.mode=ipc_buffer", "rollout.backend=hf:d2", "actor.backend=fsdp:d2")
    cfg = tiny_run_config(tmp_path, tiny_model, *overrides)
    asyncio.run(run(cfg))
    rows = _assert_synced_every_step(cfg)
    assert all(r["sync/bytes"] > 0 for r in rows)
    assert _weight_files() == before  # the file's name is gone once the engines mapped it


def test_disk_mode_matches_trainer_every_step_and_removes_folders(tmp_path, tiny_model):
    cfg = tiny_run_config(tmp_path, tiny_model, "weight_sync.mode=disk", "saver.hf_export=false")
    asyncio.run(run(cfg))
    _assert_synced_every_step(cfg)
    weights = cfg.run_path / "weights"
    assert not weights.exists() or not any(weights.iterdir())


async def _until_engines_run_rows(rollout, polls: int = 1200) -> int:
    """Wait (for a state, not a duration; 60 s at most) until the engines of ``rollout`` (a
    `RolloutController`) run rows; returns how many they run then (0 if none came)."""
    running = 0
    for _ in range(polls):
        running = sum(
            h["running"] for h in await asyncio.gather(*(w.health() for w in rollout.workers))
        )
        if running:
            break
        await asyncio.sleep(0.05)
    return running


def _record_pauses(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Make every rollout pause record the engines' health right after it; the first waits
    (for a state, not a duration) until the engines run rows, so that sync has some to keep."""
    from arl.control.rollout import RolloutController

    pause = RolloutController.pause
    seen: list[dict] = []

    async def recorded_pause(self: RolloutController, in_place: bool = False) -> None:
        running = await _until_engines_run_rows(self, polls=0 if seen else 1200)
        await pause(self, in_place)
        healths = await asyncio.gather(*(w.health() for w in self.workers))
        seen.append({"running_before": running, "after": healths})

    monkeypatch.setattr(RolloutController, "pause", recorded_pause)
    return seen


@pytest.mark.parametrize("in_place", [True, False])
def test_a_sync_keeps_or_aborts_running_generations_as_weight_sync_in_place_says(
    tmp_path, tiny_model, monkeypatch, in_place
):
    """With ``weight_sync.in_place`` the first sync finds generations running and keeps them in
    the hf engine (held, not aborted); without it they are aborted and resubmitted. Either way
    they finish under the new weights (a finished group holds tokens of versions 0 and 1)
    and every engine holds the trainer's weights. Two groups
    at a time, with room for five batches ahead of training (eta 4), so the engine is still
    generating when the first sync comes."""
    from arl.control.rollout import RolloutController

    pauses = _record_pauses(monkeypatch)
    # Which groups the later steps train depends on how far rollout ran ahead (on a slow
    # machine they may all be older ones), so the groups are checked as they finish.
    spans: list[tuple[int, int]] = []
    accepts = RolloutController._accepts

    def recorded_accepts(self: RolloutController, key: str, info) -> bool:
        spans.append((info.min_version, info.max_version))
        return accepts(self, key, info)

    monkeypatch.setattr(RolloutController, "_accepts", recorded_accepts)
    cfg = tiny_run_config(
        tmp_path,
        tiny_model,
        f"weight_sync.in_place={str(in_place).lower()}",
        "gconfig.max_new_tokens=384",  # with the 128-token prompts: actor.max_tokens_per_mb
        "rollout.max_concurrent_rollouts=2",
        "rollout.max_head_offpolicyness=4",
    )
    asyncio.run(run(cfg))
    rows = _assert_synced_every_step(cfg)
    assert len(pauses) >= 2 and pauses[0]["running_before"] > 0
    (first,) = pauses[0]["after"]
    if in_place:
        assert first["pause_mode"] == "in_place" and first["held"] > 0
    else:
        assert first["pause_mode"] == "abort" and first["held"] == 0 and first["running"] == 0
    assert rows[0]["rollout/version_switches"] == 0  # generated before any sync
    assert any(lo == 0 and hi >= 1 for lo, hi in spans), spans  # finished under new weights


@pytest.mark.parametrize("in_place", [True, False])
def test_alternate_gpu_sharing_holds_generation_in_place_while_training(
    tmp_path, tiny_model, monkeypatch, in_place
):
    """``rollout.gpu_sharing=alternate``: while the ranks train and sync, the engines that share
    their GPU are paused in place (rows kept, nothing generated), and they run again between
    steps; the sync inside the hold still aborts the held rows when ``weight_sync.in_place`` is
    false. The CPU plan has no GPUs to share, so `shares_gpu` is told the engine shares one;
    the nodes, the engine and the syncs are real."""
    import arl.control.workers as workers_mod
    import arl.trainer as trainer_mod
    from arl.control.rollout import RolloutController

    monkeypatch.setattr(workers_mod, "shares_gpu", lambda spec, train: spec.role == "rollout")
    seen: list[tuple[dict, dict]] = []
    at_sync: list[dict] = []
    train_step = trainer_mod.PPOTrainer.train_step
    resume = RolloutController.resume

    async def observed_resume(self, version):  # the end of the sync, still inside the hold
        at_sync.append(await self.workers[0].health())
        await resume(self, version)

    monkeypatch.setattr(RolloutController, "resume", observed_resume)
    held = RolloutController.held

    @contextlib.asynccontextmanager
    async def held_once_running(self, workers):
        # The trainer takes its batch the moment the last group of it is accepted, and on a
        # loaded machine it can enter the hold before the next groups reach the engine: wait
        # until the engine runs rows, so the hold has some to keep.
        await _until_engines_run_rows(self)
        async with held(self, workers):
            yield

    monkeypatch.setattr(RolloutController, "held", held_once_running)

    async def observed(self, batch):
        before = await self.rollout.workers[0].health()
        await asyncio.sleep(0.3)  # generation would move on here if it were not held
        out = await train_step(self, batch)
        seen.append((before, await self.rollout.workers[0].health()))
        return out

    monkeypatch.setattr(trainer_mod.PPOTrainer, "train_step", observed)
    cfg = tiny_run_config(
        tmp_path,
        tiny_model,
        "rollout.gpu_sharing=alternate",
        f"weight_sync.in_place={str(in_place).lower()}",
        "gconfig.max_new_tokens=384",
        "rollout.max_concurrent_rollouts=2",
        "rollout.max_head_offpolicyness=4",
    )
    asyncio.run(run(cfg))
    rows = _assert_synced_every_step(cfg)
    assert len(seen) == 3 and len(at_sync) == 3
    for before, after in seen:
        assert before["paused"] and before["pause_mode"] == "in_place"
        assert after["generated_tokens"] == before["generated_tokens"]  # nothing ran meanwhile
    assert any(before["held"] > 0 for before, _ in seen)  # rows were kept, not aborted
    for h in at_sync:
        assert h["paused"]  # held until the hold ends, after the sync
        if in_place:
            assert h["pause_mode"] == "in_place"
        else:
            assert h["pause_mode"] == "abort" and h["held"] == 0 and h["running"] == 0
    assert any(r["rollout/version_switches"] > 0 for r in rows[1:])


def test_only_engines_on_a_train_ranks_gpu_share_it():
    """Two engines and one train rank on two GPUs: the engine on the other GPU is not held."""
    from arl.control.placement import shares_gpu

    plan = plan_placement(_cfg("rollout.backend=hf:d2", "actor.backend=fsdp:d1"), n_gpus=2)
    got = {n.gpu_ids: shares_gpu(n, plan.train) for n in plan.rollout}
    assert got == {(0,): True, (1,): False}, (got, plan)
    cpu = plan_placement(_cfg(), n_gpus=0)
    assert not any(shares_gpu(n, cpu.train) for n in cpu.nodes)


# ---- placement of the modes -------------------------------------------------------------------
def _cfg(*overrides: str) -> Config:
    return apply_overrides(Config(), list(overrides))


def test_placement_allows_nccl_on_cpu_and_refuses_what_cannot_work():
    plan_placement(_cfg("weight_sync.mode=nccl"), n_gpus=0)  # gloo stand-in
    with pytest.raises(ConfigError, match="ipc needs GPUs"):
        plan_placement(_cfg("weight_sync.mode=ipc"), n_gpus=0)
    # One GPU shared by engine and trainer: ipc yes, nccl no (one GPU per NCCL rank).
    plan_placement(_cfg("weight_sync.mode=ipc"), n_gpus=1)
    with pytest.raises(ConfigError, match="use weight_sync.mode=ipc"):
        plan_placement(_cfg("weight_sync.mode=nccl"), n_gpus=1)
    # Separate GPUs: nccl yes, ipc no.
    plan_placement(_cfg("weight_sync.mode=nccl"), n_gpus=2)
    with pytest.raises(ConfigError, match="use weight_sync.mode=nccl"):
        plan_placement(_cfg("weight_sync.mode=ipc"), n_gpus=2)
    with pytest.raises(ConfigError, match="needs engines that accept weights as tensors"):
        plan_placement(_cfg("weight_sync.mode=nccl", "rollout.backend=sglang:d1"), n_gpus=2)


# ---- bucket helpers -------------------------------------------------------------------------
def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(7, 5, generator=g)),
        ("norm", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("steps", torch.arange(3, dtype=torch.int64)),
        ("big", torch.randn(64, 33, generator=g)),
        ("half", torch.randn(9, generator=g).to(torch.float16)),
    ]


def test_buckets_round_trip_bit_exact_through_the_wire_layout():
    named = _named()
    layouts = plan_buckets([(n, t.shape, t.dtype) for n, t in named], bucket_bytes=300)
    # Order is kept and every tensor is in exactly one bucket.
    assert [s.name for b in layouts for s in b.slots] == [n for n, _ in named]
    assert len(layouts) > 1
    for b in layouts:
        assert all(s.offset % ALIGN == 0 for s in b.slots)
        assert b.nbytes >= max(s.offset + s.nbytes for s in b.slots)
    # The tensor over the bucket size sits alone.
    assert [len(b.slots) for b in layouts if b.slots[0].name == "big"] == [1]
    buffer = new_bucket_buffer(layouts, "cpu")
    got = []
    for layout, tensors in iter_buckets(named, layouts):
        wire = BucketLayout.from_wire(layout.to_wire())  # what the receiver gets
        assert wire == layout
        filled = flatten_bucket(layout, tensors, buffer)
        assert filled.numel() == layout.nbytes
        got += [(n, v.clone()) for n, v in unflatten_bucket(wire, filled.clone())]
    assert [n for n, _ in got] == [n for n, _ in named]
    for (_, want), (_, have) in zip(named, got, strict=True):
        assert have.dtype == want.dtype and torch.equal(have, want)


def test_flatten_casts_to_the_planned_dtype():
    t = torch.randn(4, 4)
    (layout,) = plan_buckets([("w", t.shape, torch.bfloat16)], bucket_bytes=1 << 20)
    buffer = new_bucket_buffer([layout], "cpu")
    ((_, view),) = unflatten_bucket(layout, flatten_bucket(layout, [t], buffer))
    assert view.dtype == torch.bfloat16 and torch.equal(view, t.to(torch.bfloat16))


def test_bucket_stream_refuses_a_model_that_changed_since_planning():
    named = _named()
    layouts = plan_buckets([(n, t.shape, t.dtype) for n, t in named], bucket_bytes=1 << 20)
    with pytest.raises(WeightTransferError, match="expected weight 'embed' next"):
        list(iter_buckets(named[1:], layouts))
    with pytest.raises(WeightTransferError, match="not in any bucket"):
        list(iter_buckets([*named, ("extra", torch.zeros(1))], layouts))
    with pytest.raises(WeightTransferError, match="ended before"):
        list(iter_buckets(named[:-1], layouts))
    buffer = new_bucket_buffer(layouts, "cpu")
    wrong = [t.reshape(-1) for _, t in named]
    with pytest.raises(WeightTransferError, match="changed shape"):
        flatten_bucket(layouts[0], wrong, buffer)
    bad = layouts[0].to_wire()
    bad["nbytes"] = 8
    with pytest.raises(WeightTransferError, match="does not fit"):
        BucketLayout.from_wire(bad)


def test_gloo_group_broadcasts_buckets_to_two_receivers():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    named = _named()
    layouts = plan_buckets([(n, t.shape, t.dtype) for n, t in named], bucket_bytes=300)
    received: dict[int, list] = {1: [], 2: []}
    results: dict[int, object] = {}

    def member(rank: int) -> None:
        try:
            group = BroadcastGroup("127.0.0.1", port, rank, 3, "gloo", timeout_s=30)
            try:
                if rank == 0:
                    results[rank] = broadcast_buckets(group, named, layouts, "cpu")
                else:

                    def load(views):
                        received[rank].extend((n, v.clone()) for n, v in views)
                        return len(views)

                    results[rank] = receive_buckets(group, layouts, "cpu", load)
            finally:
                group.close()
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            results[rank] = e

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results[0] == sum(b.nbytes for b in layouts)
    assert results[1] == results[2] == len(named)
    for rank in (1, 2):
        for (n, want), (m, have) in zip(named, received[rank], strict=True):
            assert n == m and torch.equal(have, want)
