"""An hf engine's start-up and first generation, with flex attention compiled (and, on CUDA, the
fused decode functions), for comparing runs on an empty and a filled ``ARL_CACHE``, with and
without `arl.precompile` (``ARL_PRECOMPILE=0``).

    PYTHONPATH=. python3 docs/results/startup_h200/s25_precompile_engine.py MODEL DEVICE ROWS

On CPU: float32, no CUDA graphs, flex compiled by inductor's C++ backend at each row bucket the
generation drains through. On CUDA: bfloat16, CUDA graphs warmed up to 193 positions. Prints
one JSON line: seconds for the build and the generation, dynamo's traced graphs, and what
`arl.precompile` loaded and compiled.
"""

import asyncio
import json
import sys
import time

import torch
from torch._dynamo.utils import counters

from arl.engines.base import SamplingParams
from arl.engines.hf import flex
from arl.engines.hf.engine import HFEngine

model, device, rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
on_cuda = device.startswith("cuda")
t0 = time.perf_counter()
engine = HFEngine(
    model,
    device=device,
    dtype="bfloat16" if on_cuda else "float32",
    max_batch_size=rows,
    max_seq_len=512,
    decode_attention="flex",
    compile_blocks=True,
    warm_up_len=193 if on_cuda else 0,
)
build_s = time.perf_counter() - t0


async def generate() -> int:
    # Completions of different lengths: the batch drains through every row bucket.
    tasks = [
        engine.agenerate(list(range(5, 5 + 3 + i % 7)), SamplingParams(max_new_tokens=4 + 6 * i))
        for i in range(rows)
    ]
    return sum(len(r.output_ids) for r in await asyncio.gather(*tasks))


t1 = time.perf_counter()
tokens = asyncio.run(generate())
generate_s = time.perf_counter() - t1
kept = [flex._COMPILED]
if engine._fused is not None:
    kept += [engine._fused._attn_in, engine._fused._attn_out, engine._fused._head]
print(
    json.dumps(
        {
            "build_s": round(build_s, 2),
            "load_s": round(engine.load_s, 2),
            "compile_s": round(engine.compile_s, 2),
            "generate_s": round(generate_s, 2),
            "tokens": tokens,
            "dynamo_graphs": counters["stats"]["unique_graphs"],
            "precompiled_loaded": sum(getattr(f, "loaded", 0) for f in kept),
            "precompiled_compiled": sum(getattr(f, "compiled", 0) for f in kept),
            "torch": torch.__version__,
        }
    )
)
engine.close()
