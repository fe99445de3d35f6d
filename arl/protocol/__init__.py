"""What crosses a process boundary, shared by both sides (DESIGN §9).

rtensor (shard refs, batches), report (group reports, trajectories), errors (the remote error
table), remote (typed worker interfaces), imports (the import rule), stall (stall reports),
shards (shard metadata, tensor slots), wire (the one strict converter every wire struct uses).
"""
