"""The node config the controller hands every node in its hello reply: built from the run's
config, round-tripped through its wire map, and refused naming the field when malformed."""

from __future__ import annotations

import pytest

from arl.config import Config, apply_overrides
from arl.control.cluster import node_config
from arl.protocol.node_config import NodeConfig, NodeConfigError


def test_node_config_carries_the_runs_cluster_and_transport_settings():
    cfg = apply_overrides(
        Config(),
        [
            "cluster.heartbeat_interval=0.5",
            "cluster.heartbeat_timeout=7",
            "cluster.allowed_import_prefixes=[arl.,my_recipes.]",
            "transport.max_message_bytes=1048576",
            "transport.pull_chunk_bytes=65536",
            "transport.shared_memory=false",
        ],
    )
    nc = node_config(cfg)
    assert nc == NodeConfig(
        heartbeat_interval=0.5,
        heartbeat_timeout=7.0,
        allowed_import_prefixes=("arl.", "my_recipes."),
        max_message_bytes=1048576,
        pull_chunk_bytes=65536,
        shared_memory=False,
    )
    assert NodeConfig.from_wire(nc.to_wire()) == nc


@pytest.mark.parametrize(
    "change, says",
    [
        ({"heartbeat_timeout": "10"}, "'heartbeat_timeout' must be a number, got '10'"),
        ({"shared_memory": 1}, "'shared_memory' must be true or false, got 1"),
        ({"max_message_bytes": True}, "'max_message_bytes' must be an integer, got True"),
        (
            {"allowed_import_prefixes": "arl."},
            "'allowed_import_prefixes' must be a list of strings, got 'arl.'",
        ),
        ({"heartbeat_interval": 0.0}, "heartbeat_interval=0.0: must be > 0"),
        ({"extra": 1}, "unknown field(s) ['extra']"),
    ],
)
def test_a_malformed_node_config_is_refused_naming_the_field(change, says):
    wire = {**NodeConfig().to_wire(), **change}
    with pytest.raises(NodeConfigError) as info:
        NodeConfig.from_wire(wire)
    assert says in str(info.value)


def test_a_node_config_missing_a_field_is_refused():
    wire = NodeConfig().to_wire()
    del wire["shared_memory"]
    with pytest.raises(NodeConfigError, match="'shared_memory' must be true or false, it is miss"):
        NodeConfig.from_wire(wire)
