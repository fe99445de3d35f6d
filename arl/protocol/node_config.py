"""What a node needs from the run's config, handed to it in the controller's hello reply.

A node started by arl's launchers gets the same values as flags, but one started by a job
script (``cluster.launcher=attach``: ``srun arl-node --controller ...``) knows only its default
flags. So the controller answers every hello with a `NodeConfig` built from the run's config,
and the daemon applies it before it serves any call: heartbeats, the import prefixes its
``create`` calls and workflows are checked against, the message size cap, and its data plane.
A controller embedded without one (``Controller(node_config=None)``) sends none, and the node
keeps its flags.
"""

from __future__ import annotations

from typing import Any

import attrs

from arl.protocol.wire import WireStruct, WireStructError

MiB = 2**20


class NodeConfigError(WireStructError):
    """A node config map that is not one (a missing, unknown or mistyped field)."""


def _positive(inst: Any, a: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise NodeConfigError(f"{a.name}={value!r}: must be > 0")


@attrs.frozen(kw_only=True)
class NodeConfig(WireStruct):
    """The run's settings a node applies (``cluster.*`` and ``transport.*`` of the same name).

    Every field travels; a node refuses a map with one missing or unknown (`WireStruct`).
    """

    wire_error = NodeConfigError

    heartbeat_interval: float = attrs.field(default=1.0, validator=_positive)
    heartbeat_timeout: float = attrs.field(default=10.0, validator=_positive)
    allowed_import_prefixes: tuple[str, ...] = ("arl.",)
    max_message_bytes: int = -1  # <= 0: no cap
    # Chosen by `python -m arl.bench rtensor --chunk-mib 1 4 16 64` (arl.node.data_plane).
    pull_chunk_bytes: int = attrs.field(default=MiB, validator=_positive)
    shared_memory: bool = True
