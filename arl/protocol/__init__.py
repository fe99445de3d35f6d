"""What crosses a process boundary, shared by both sides (DESIGN §9).

rtensor (shard refs, batches), report (group reports, trajectories), errors (the remote error
table), remote (typed worker interfaces), proxy (the typed callers generated from them), hosting
(what a node hands the objects it hosts), weight_hooks (the workers' weight-sync hooks), imports
(the import rule), stall (stall reports).
"""
