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

from collections.abc import Mapping
from typing import Any

import attrs

from arl.protocol.errors import ErrorKind

MiB = 2**20


class NodeConfigError(ValueError):
    """A node config map that is not one (a missing, unknown or mistyped field)."""

    error_kind = ErrorKind.MALFORMED


def _positive(inst: Any, a: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise NodeConfigError(f"{a.name}={value!r}: must be > 0")


@attrs.frozen(kw_only=True)
class NodeConfig:
    """The run's settings a node applies (``cluster.*`` and ``transport.*`` of the same name)."""

    heartbeat_interval: float = attrs.field(default=1.0, validator=_positive)
    heartbeat_timeout: float = attrs.field(default=10.0, validator=_positive)
    allowed_import_prefixes: tuple[str, ...] = ("arl.",)
    max_message_bytes: int = -1  # <= 0: no cap
    # Chosen by `python -m arl.bench rtensor --chunk-mib 1 4 16 64` (arl.node.data_plane).
    pull_chunk_bytes: int = attrs.field(default=MiB, validator=_positive)
    shared_memory: bool = True

    def to_wire(self) -> dict[str, Any]:
        """Plain msgpack-able map."""
        d = attrs.asdict(self)
        d["allowed_import_prefixes"] = list(self.allowed_import_prefixes)
        return d

    @classmethod
    def from_wire(cls, d: Any) -> NodeConfig:
        """Check every field of the map ``d``; `NodeConfigError` names the first one wrong."""
        if not isinstance(d, Mapping):
            raise NodeConfigError(f"a node config must be a map, got {type(d).__name__}")
        names = {a.name: a for a in attrs.fields(cls)}
        unknown = sorted(set(d) - set(names))
        missing = sorted(set(names) - set(d))
        if unknown or missing:
            raise NodeConfigError(
                f"node config fields: unknown {unknown}, missing {missing} "
                "(node and controller of different arl versions?)"
            )
        kinds = {"heartbeat_interval": (int, float), "heartbeat_timeout": (int, float)}
        kinds |= {"max_message_bytes": int, "pull_chunk_bytes": int, "shared_memory": bool}
        for name, kind in kinds.items():
            v = d[name]
            if not isinstance(v, kind) or (kind is not bool and isinstance(v, bool)):
                raise NodeConfigError(f"node config {name}={v!r}: wrong type")
        prefixes = d["allowed_import_prefixes"]
        if not isinstance(prefixes, list) or not all(isinstance(p, str) for p in prefixes):
            raise NodeConfigError(
                f"node config allowed_import_prefixes={prefixes!r}: must be a list of str"
            )
        return cls(**{**d, "allowed_import_prefixes": tuple(prefixes)})
