"""Services a node runs beside its control-plane loop: the shard store and its data plane."""

from __future__ import annotations

from typing import Any

from arl.node.data_plane import NodeDataPlane


async def start_services(node: Any) -> list[Any]:
    """Start the node's services; each has ``async close()`` and may offer ``stats()``.

    The data plane serves this node's shard store on the node's bound data ROUTER and pulls
    the shards named by RTensor arguments of incoming calls (``materialize``); it is built from
    the node's config (`arl.protocol.node_config.NodeConfig`), so it starts once that is final.
    """
    cfg = node.config
    data_plane = NodeDataPlane.start(
        run_id=node.run_id,
        node_id=node.node_id,
        ctx=node.ctx,
        security=node.security,
        socket=node.data_sock,
        shared_memory=cfg.shared_memory,
        chunk_bytes=cfg.pull_chunk_bytes,
        max_message_bytes=cfg.max_message_bytes,
    )
    node.store = data_plane.store
    return [data_plane]
