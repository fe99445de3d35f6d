"""The train rank's priming, pass by pass: a fresh process builds one CUDA rank of
`arl.train.fsdp.FSDPEngine` (SmolLM2-135M's shape unless MODEL says otherwise) without its
priming, then times each pass that `prime` and `warm_up` run, alone, in their order: a forward
with backward (``grad``) and one without (``nograd``) on two small packed batches, then on the
warm-up's batch of 32 rows of 512 tokens.

    PYTHONPATH=. python3 docs/results/startup_h200/s33_prime_probe.py MODEL [ORDER]

ORDER is a comma-separated list of ``grad:SHAPE`` / ``nograd:SHAPE`` with SHAPE one of
``a`` (48, 80, 72), ``b`` (120, 33, 97, 64) and ``big`` (32 x 512); the default is the order the
engine runs them in. Prints one JSON line: seconds per pass, what `arl.precompile` loaded and
compiled, and dynamo's graph count. ``TORCH_LOGS=recompiles`` says why a pass compiles;
``PROBE_PROFILE=1`` prints where the build's seconds go.
"""

import cProfile
import json
import logging
import os
import pstats
import sys
import time

import torch
from torch._dynamo.utils import counters

from arl.config.tree import ActorConfig
from arl.train import fsdp
from arl.train.logp import forward_logp

SHAPES = {"a": [48, 80, 72], "b": [120, 33, 97, 64], "big": [512] * 32}
DEFAULT = "grad:a,nograd:a,grad:b,nograd:b,grad:big,nograd:big"

logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
logging.getLogger("arl.precompile").setLevel(logging.DEBUG)  # compiled in / kept in
path = sys.argv[1]
order = (sys.argv[2] if len(sys.argv) > 2 else DEFAULT).split(",")
fsdp.FSDPEngine.prime = lambda self: 0.0  # the passes below, one at a time
profiler = cProfile.Profile() if os.environ.get("PROBE_PROFILE") else None
if profiler is not None:  # where the build's seconds go, printed to stderr
    profiler.enable()
t0 = time.perf_counter()
eng = fsdp.FSDPEngine(
    ActorConfig(path=path),
    rank=0,
    world_size=1,
    init_method="tcp://127.0.0.1:29533",
    device=os.environ.get("DEVICE", "cuda"),
)
built_s = time.perf_counter() - t0
if profiler is not None:
    profiler.disable()
    pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
out: dict = {"built_s": round(built_s, 2), "load_s": round(eng.load_s, 2)}
for item in order:
    mode, shape = item.split(":")
    lens = torch.tensor(SHAPES[shape], device=eng.device)
    am = torch.arange(int(lens.max()), device=eng.device)[None] < lens[:, None]
    ids = torch.ones_like(am, dtype=torch.long) * am
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.set_grad_enabled(mode == "grad"):
        logp, _ = forward_logp(eng.forward_model, ids, am, 1.0, eng.layout, SHAPES[shape])
        if mode == "grad":
            (logp.sum() * 0.0).backward()
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    out[item] = round(time.perf_counter() - t, 2)
eng.zero_grad()
out["precompiled (loaded, compiled)"] = fsdp.kept_functions(eng.forward_model, eng.device)
out["dynamo_graphs"] = counters["stats"]["unique_graphs"]
out["torch"] = torch.__version__
print(json.dumps(out))
