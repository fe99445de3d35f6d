"""Decode ms/step of the hf engine at batch 256 with the triton decode attention (random
SmolLM2-135M, 256 new tokens; uniform 128-token prompts, mixed 64..1044), two whole generations
each. Session 34 ran it twice in one call: as main is, and with the fused decode functions
(`attn_proj`, `attn_out`) compiled under the inductor options in ``ARL_TMP_FUSED_OPTS``
(max-autotune, Triton and ATen GEMMs), through a temporary switch in
`arl/engines/hf/fused.py` that was measured and not kept.
Usage: ``python s34_dec_ab.py [uniform] [mixed]`` (GPU)."""

import json
import os
import sys
from pathlib import Path

from arl.bench.gpu import bench_engine, mixed_lengths, prepare_model

path = prepare_model("random", None, Path("/tmp/r"))
batch, new = 256, 256
out = {}
for kind in sys.argv[1:] or ["uniform", "mixed"]:
    lengths = [128] * batch if kind == "uniform" else mixed_lengths(batch, 64, 1300 - new)
    walls = []
    for _ in range(2):
        e = bench_engine(path, batch, lengths, new, decode_attention="triton")
        walls.append(e["wall"] / new)
    out[kind] = [round(1e3 * w, 3) for w in walls]
    print(kind, "ms/step", out[kind], "tok/s", [round(batch / w) for w in walls], flush=True)
print(json.dumps({"opts": os.environ.get("ARL_TMP_FUSED_OPTS"), **out}))
