"""The FSDP2 training rank (DESIGN §9 ``train/``): `fsdp.FSDPEngine`, the model it loads and
shards (`sharding`), the log-probs of its tokens (`logp`) and the statistics of its update
(`stats`). The node's train worker (`arl.node.train`) serves it; the maths is `arl.algo`'s."""
