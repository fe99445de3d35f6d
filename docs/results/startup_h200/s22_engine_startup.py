"""Where an hf engine's start-up goes on a GPU: load, compile and decode-graph phases, each
bucket's capture time, and dynamo's compile times and counts.

    PYTHONPATH=. python3 docs/results/startup_h200/s22_engine_startup.py MODEL ROWS WARM_UP_LEN

Run it twice with the same ``TORCHINDUCTOR_CACHE_DIR`` (fresh, then filled) for cold and warm.
"""

import logging
import sys
import time

import torch._dynamo.utils as dynamo_utils
from torch._dynamo.utils import compile_times

from arl.engines.hf.engine import HFEngine

logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f %(name)s %(message)s")
logging.getLogger("arl.engines.hf.graphs").setLevel(logging.DEBUG)

model, rows, length = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
engine = HFEngine(
    model,
    device="cuda",
    dtype="bfloat16",
    max_batch_size=rows,
    max_seq_len=2048,
    warm_up_len=length,
)
print(
    f"TOTAL {time.perf_counter() - t0:.2f} load {engine.load_s:.2f} "
    f"compile {engine.compile_s:.2f} graphs {engine.warm_up_s:.2f}",
    flush=True,
)
print(compile_times(repr="str", aggregate=True))
print(dict(dynamo_utils.counters["stats"]))
print({k: dict(v) for k, v in dynamo_utils.counters.items() if k in ("inductor", "aot_autograd")})
engine.close()
