"""ShardStore: put/get/free accounting, shared-memory segments and their cleanup."""

import os
import signal
import subprocess
import sys
import uuid

import pytest
import torch

from arl.node.shard_store import (
    SHM_DIR,
    ShardExists,
    ShardNotFound,
    ShardStore,
    map_segment,
    sweep_orphans,
    tensor_views,
)


def _run_id() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def _held(store: ShardStore) -> tuple[int, int]:
    st = store.stats()
    return st["bytes_held"], st["n_shards"]


def _shard(seq: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seq)
    mask = torch.ones(2, seq, dtype=torch.int64)
    mask[1, seq - 2 :] = 0
    return {
        "input_ids": torch.randint(0, 50_000, (2, seq), generator=g),
        "attention_mask": mask,
        "logprobs": torch.randn(2, seq, generator=g).to(torch.bfloat16),
        "rewards": torch.tensor([1.0, -0.5], dtype=torch.float64),
        "done": torch.tensor([True, False]),
        "scalar": torch.tensor(3, dtype=torch.int32),
        "empty": torch.empty(0, 5),
    }


def _segments(run_id: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"arl-{run_id}-"))


@pytest.mark.parametrize("shared_memory", [True, False])
def test_put_get_free_accounting(shared_memory: bool) -> None:
    store = ShardStore(_run_id(), "n0", shared_memory=shared_memory)
    try:
        a, b = _shard(7), _shard(300)
        meta = store.put("a", a)
        store.put("b", b)
        assert meta.nbytes == sum(t.nbytes for t in a.values())
        assert meta.n_tokens == 12  # sum of attention_mask, not numel
        assert meta.shapes["logprobs"] == [2, 7] and meta.dtypes["logprobs"] == "bfloat16"
        assert meta.shapes["scalar"] == [] and meta.dtypes["done"] == "bool"
        total = meta.nbytes + sum(t.nbytes for t in b.values())
        assert _held(store) == (total, 2)
        got = store.get("a")
        for name, t in a.items():
            assert got[name].dtype == t.dtype and got[name].shape == t.shape
            assert torch.equal(got[name], t)
        assert store.free(["a"]) == meta.nbytes
        assert _held(store) == (total - meta.nbytes, 1)
        with pytest.raises(ShardNotFound, match="'a' is not held by node n0"):
            store.get("a")
    finally:
        store.close()
    assert _held(store) == (0, 0)


def test_put_copies_so_later_writes_to_the_source_do_not_leak_in() -> None:
    store = ShardStore(_run_id())
    try:
        src = {"x": torch.arange(10)}
        store.put("k", src)
        src["x"].zero_()
        assert torch.equal(store.get("k")["x"], torch.arange(10))
    finally:
        store.close()


def test_n_tokens_without_a_mask_counts_input_ids() -> None:
    store = ShardStore(_run_id(), shared_memory=False)
    assert store.put("k", {"input_ids": torch.zeros(3, 11, dtype=torch.int64)}).n_tokens == 33
    assert store.put("v", {"values": torch.zeros(4)}).n_tokens == 0


def test_double_free_and_unknown_keys_are_noops() -> None:
    store = ShardStore(_run_id())
    try:
        n = store.put("k", _shard()).nbytes
        # A shard referenced twice in a batch is freed once.
        assert store.free(["k", "k", "never-stored"]) == n
        assert store.free(["k"]) == 0
        assert _held(store) == (0, 0)
    finally:
        store.close()


def test_duplicate_key_is_refused_and_leaves_no_segment() -> None:
    run_id = _run_id()
    store = ShardStore(run_id, "n3")
    try:
        store.put("k", _shard())
        with pytest.raises(ShardExists, match="node n3 already holds shard 'k'"):
            store.put("k", _shard())
        assert len(_segments(run_id)) == 1
    finally:
        store.close()


def test_non_tensor_values_are_refused() -> None:
    store = ShardStore(_run_id(), shared_memory=False)
    with pytest.raises(TypeError, match="entry 'x' is list"):
        store.put("k", {"x": [1, 2]})


def test_segment_file_is_gone_after_free_and_close() -> None:
    run_id = _run_id()
    store = ShardStore(run_id)
    store.put("a", _shard())
    store.put("b", _shard(9))
    names = _segments(run_id)
    assert len(names) == 2 and all(f"-{os.getpid()}-" in n for n in names)
    assert store.entry("a").segment in names
    store.free(["a"])
    assert _segments(run_id) == [store.entry("b").segment]
    store.close()
    assert _segments(run_id) == []


def test_consumer_mapping_stays_valid_after_owner_frees() -> None:
    run_id = _run_id()
    owner = ShardStore(run_id, "owner")
    shard = _shard(64)
    owner.put("k", shard)
    entry = owner.entry("k")
    mapping = map_segment(entry.segment, entry.size)
    seen = tensor_views(mapping, entry.slots)
    owner.free(["k"])
    owner.close()
    assert _segments(run_id) == []
    for name, t in shard.items():
        assert torch.equal(seen[name], t)
    seen["logprobs"].zero_()  # copy-on-write: the consumer may write its private view


def test_pulled_copies_count_in_the_consumer_store() -> None:
    owner, consumer = ShardStore(_run_id(), "o"), ShardStore(_run_id(), "c")
    try:
        meta = owner.put("k", _shard())
        entry = owner.entry("k")
        assert consumer.add_copy(meta, entry.slots, map_segment(entry.segment, entry.size))
        assert not consumer.add_copy(meta, entry.slots, entry.buffer)  # already held
        assert _held(consumer) == (meta.nbytes, 1)
        assert consumer.free(["k"]) == meta.nbytes
        assert consumer.stats()["bytes_held"] == 0
        assert owner.stats()["bytes_held"] == meta.nbytes  # the owner's copy is its own
    finally:
        owner.close()
        consumer.close()


_OWNER = """
import sys, torch
from arl.node.shard_store import ShardStore
store = ShardStore(sys.argv[1], "victim")
for i in range(3):
    store.put(f"k{i}", {"x": torch.arange(1000)})
print("ready", flush=True)
sys.stdin.read()
"""


def test_sweep_orphans_removes_segments_of_a_sigkilled_owner() -> None:
    run_id = _run_id()
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _OWNER, run_id],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        assert len(_segments(run_id)) == 3
        mine = ShardStore(run_id, "survivor")
        mine.put("mine", {"x": torch.arange(5)})
        assert sweep_orphans(run_id) == []  # the owner is alive: nothing to sweep
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert len(_segments(run_id)) == 4  # SIGKILL runs no cleanup
        removed = sweep_orphans(run_id)
        assert len(removed) == 3 and all(f"-{proc.pid}-" in n for n in removed)
        assert _segments(run_id) == [mine.entry("mine").segment]  # a live owner's stays
        mine.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for name in _segments(run_id):
            os.unlink(os.path.join(SHM_DIR, name))


def test_sweep_ignores_runs_whose_id_only_starts_like_ours() -> None:
    run_id = _run_id()
    other = os.path.join(SHM_DIR, f"arl-{run_id}-x-999999-0")
    open(other, "wb").close()
    try:
        assert sweep_orphans(run_id) == []
        assert os.path.exists(other)
    finally:
        os.unlink(other)


def test_owner_exiting_normally_unlinks_its_segments() -> None:
    run_id = _run_id()
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", _OWNER, run_id], input=b"", capture_output=True, env=env
    )
    assert out.returncode == 0 and out.stdout.strip() == b"ready", out.stderr
    assert _segments(run_id) == []


def test_freed_private_buffers_are_recycled_only_when_nothing_views_them() -> None:
    store = ShardStore(_run_id(), shared_memory=False, pool_bytes=64 << 20)
    store.put("a", {"x": torch.arange(100_000)})
    store.free(["a"])
    pooled = store.stats()["bytes_pooled"]
    assert pooled >= 800_000
    store.put("b", {"x": torch.arange(100_000)})  # takes the pooled buffer
    assert store.stats()["bytes_pooled"] == 0
    kept = store.get("b")["x"][10:20]  # a view that outlives the shard
    store.free(["b"])
    assert store.stats()["bytes_pooled"] == 0  # still viewed: not reused
    store.put("c", {"x": torch.zeros(100_000, dtype=torch.int64)})
    assert torch.equal(kept, torch.arange(10, 20))
    del kept
    store.free(["c"])
    assert store.stats()["bytes_pooled"] == pooled


def test_pool_is_bounded() -> None:
    store = ShardStore(_run_id(), shared_memory=False, pool_bytes=1 << 20)
    for k in "abc":
        store.put(k, {"x": torch.zeros(100_000)})
    store.free(["a", "b", "c"])
    assert 0 < store.stats()["bytes_pooled"] <= 1 << 20
    store.close()
    assert store.stats()["bytes_pooled"] == 0
