"""A node hands a new object what its creator declares: objects it already hosts (``hosted``)
and, to a `UsesNode` class, the node itself."""

from __future__ import annotations

import asyncio

import pytest

from arl.protocol.errors import RemoteError
from arl.protocol.proxy import proxy
from tests.support.cluster import local_cluster
from tests.support.objects import Beside


def test_hosted_objects_and_the_node_are_handed_in_at_creation() -> None:
    async def main() -> tuple:
        async with local_cluster(1) as (_, (node,), _p):
            await node.create("tests.support.objects:Echo", "the-tag", name="train")
            beside = proxy(
                Beside,
                await node.create("tests.support.objects:Beside", hosted={"host": "train"}),
            )
            got = await beside.host_tag(), await beside.node_id()
            with pytest.raises(RemoteError) as missing:
                await node.create("tests.support.objects:Beside", hosted={"host": "rollout"})
            return got, str(missing.value), node.node_id

    (tag, node_id), missing, want_id = asyncio.run(main())
    assert tag == "the-tag" and node_id == want_id
    assert "needs the object(s) ['rollout']" in missing
    assert "which hosts ['Beside-0', 'train']" in missing
