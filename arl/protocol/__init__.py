"""What crosses a process boundary, shared by both sides (DESIGN §9).

rtensor (shard refs, batches), report (group reports, trajectories), errors (the remote error
table), remote (typed worker interfaces), proxy (the typed callers generated from them), hosting
(what a node hands the objects it hosts), weight_hooks (the workers' weight-sync hooks), imports
(the import rule), stall (stall reports), plan (the placement plan: node specs and the resolved
weight-sync mode), handles (the started cluster as the plug-ins below control/ use it), shards
(shard metadata, tensor slots), dtypes (the wire dtypes), wire (the one strict converter every
wire struct uses).
"""
