"""Services a node runs beside its control-plane loop: the shard store and its data plane."""

from __future__ import annotations

from typing import Any


async def start_services(node: Any) -> list[Any]:
    """Start the node's services; each has ``async close()`` and may offer ``stats()``."""
    return []
