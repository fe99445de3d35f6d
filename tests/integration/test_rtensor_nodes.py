"""RTensor on real nodes: produced on 2 rollout-like nodes, pulled by 2 train-like nodes."""

from __future__ import annotations

import asyncio
import random

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arl.control.dispatch import dispatch
from arl.protocol.proxy import proxy
from arl.protocol.rtensor import RTensor, ShardRef
from tests.support.cluster import local_cluster
from tests.support.objects import ShardLab, make_group

LAB = "tests.support.objects:ShardLab"


async def _produce(producers, specs, prefix):
    """Store group i (seed, size, max_len) on producer i % 2; returns the RTensor."""
    metas = await asyncio.gather(
        *(
            producers[i % 2][1].produce(f"{prefix}{i}", seed, size, max_len)
            for i, (seed, size, max_len) in enumerate(specs)
        )
    )
    refs = [
        ShardRef.from_meta(producers[i % 2][0].node_id, m, specs[i][1]) for i, m in enumerate(metas)
    ]
    peers = {n.node_id: n.info["data_addr"] for n, _ in producers}
    return RTensor(refs, peers=peers)


async def _free(nodes, batch):
    await asyncio.gather(*(n.call("free", {"keys": batch.keys}) for n in nodes))


def _cluster_test(body):
    async def main():
        async with local_cluster(4) as (ctl, nodes, _):
            labs = [(n, proxy(ShardLab, await n.create(LAB))) for n in nodes]
            await body(ctl, nodes, labs[:2], labs[2:])

    asyncio.run(main())


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(1, 6), st.integers(1, 300)),
        min_size=1,
        max_size=12,
    )
)
def test_batch_pulled_by_two_ranks_merges_back_identical_and_in_order(specs):
    async def body(ctl, nodes, producers, consumers):
        batch = await _produce(producers, specs, "p")
        parts, assignment = dispatch(batch, 2)
        pulled = await asyncio.gather(
            *(lab.fetch(part.to_wire()) for (_, lab), part in zip(consumers, parts, strict=True))
        )
        merged: list = [None] * len(specs)  # back in the batch's order
        for part, idx in zip(pulled, assignment, strict=True):
            assert len(part) == len(idx)
            for got, i in zip(part, idx, strict=True):
                merged[i] = got
        for (seed, size, max_len), got in zip(specs, merged, strict=True):
            want = make_group(seed, size, max_len)
            assert set(got) == set(want)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        await _free(nodes, batch)

    _cluster_test(body)


def test_controller_carries_no_tensor_payload():
    """Control-plane bytes per cycle do not grow with sequence length."""

    async def body(ctl, nodes, producers, consumers):
        def specs(max_len):
            return [(s, 4, max_len) for s in range(8)]

        used = {}
        for max_len in (16, 4096):
            batch = await _produce(producers, specs(max_len), f"L{max_len}-")
            before = ctl.bytes_in + ctl.bytes_out
            parts, _ = dispatch(batch, 2)
            await asyncio.gather(
                *(
                    lab.digest(part.to_wire())
                    for (_, lab), part in zip(consumers, parts, strict=True)
                )
            )
            await _free(nodes, batch)
            used[max_len] = ctl.bytes_in + ctl.bytes_out - before
            assert batch.nbytes > 0
        # 256x longer sequences (MBs of shards) cost the controller about the same few KB.
        assert used[4096] < 1.5 * used[16] + 2048, used
        assert used[4096] < 64 * 1024

    _cluster_test(body)


def test_fifty_cycles_return_every_node_to_baseline():
    async def body(ctl, nodes, producers, consumers):
        labs = [lab for _, lab in producers + consumers]
        base = await asyncio.gather(*(lab.stats() for lab in labs))
        rng = random.Random(0)
        for cycle in range(50):
            specs = [
                (rng.randrange(10**6), rng.randint(1, 4), rng.randint(1, 2000))
                for _ in range(rng.randint(1, 10))
            ]
            batch = await _produce(producers, specs, f"c{cycle}-")
            parts, _ = dispatch(batch, 2)
            await asyncio.gather(
                *(
                    lab.digest(part.to_wire())
                    for (_, lab), part in zip(consumers, parts, strict=True)
                )
            )
            mid = await asyncio.gather(*(lab.stats() for lab in labs))
            assert sum(s["bytes_held"] for s in mid) > 0
            await _free(nodes, batch)
        after = await asyncio.gather(*(lab.stats() for lab in labs))
        for b, a in zip(base, after, strict=True):
            assert a["bytes_held"] == b["bytes_held"] and a["n_shards"] == b["n_shards"]
            # Freed buffers may stay pooled for reuse; RSS must not keep growing.
            assert a["rss_kb"] - b["rss_kb"] < 200 * 1024, (b, a)

    _cluster_test(body)


def test_a_rank_pulling_from_a_killed_owner_fails_at_once_with_a_recoverable_kind():
    """A consumer node's pull from a producer node killed mid-pull fails long before the
    controller would declare the producer lost (heartbeat timeout 60 s here), as `peer_lost`:
    the supervisor's restart verdict comes from the error itself."""
    import os
    import signal

    from arl.protocol.errors import ErrorKind, RemoteError
    from arl.supervisor import recoverable

    async def main():
        async with local_cluster(2, heartbeat_timeout=60.0) as (ctl, nodes, procs):
            labs = [(n, proxy(ShardLab, await n.create(LAB))) for n in nodes]
            (owner, owner_lab), (_, lab) = labs
            meta = await owner_lab.produce("g0", 7, 4, 64)
            batch = RTensor(
                [ShardRef.from_meta(owner.node_id, meta, 4)],
                peers={owner.node_id: owner.info["data_addr"]},
            )
            first = await lab.digest(batch.to_wire())  # the consumer's connection is made
            await nodes[1].call("free", {"keys": batch.keys})
            pid = procs.pids[procs.node_ids.index(owner.node_id)]
            os.kill(pid, signal.SIGSTOP)  # frozen: the next pull waits on it
            try:
                call = asyncio.ensure_future(lab.digest(batch.to_wire()))
                done, _ = await asyncio.wait([call], timeout=0.5)
                assert not done
            finally:
                os.kill(pid, signal.SIGKILL)
            try:
                await asyncio.wait_for(call, 20.0)  # the pull's own timeout is 30 s
            except RemoteError as e:
                err = e
            else:
                raise AssertionError("the pull from a killed owner succeeded")
            assert err.kind is ErrorKind.PEER_LOST and recoverable(err), err
            # "closed": the pull was in flight at the kill; "nothing listens": it began after.
            assert "closed the connection" in err.remote_message or (
                "nothing listens" in err.remote_message
            ), err
            assert len(first) == 1

    asyncio.run(main())
