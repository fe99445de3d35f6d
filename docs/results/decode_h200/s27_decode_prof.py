"""Profile whole generations of the hf engine (SmolLM2-135M's shape, random weights): kernel time
by name, the GPU's busy time against the wall.

    python3 s27_decode_prof.py KIND BATCH NEW [serial]

KIND is ``mixed`` (prompts 64..1044 tokens, as ``arl.bench gpu``'s decode_flex) or ``uniform``
(128 tokens); ``serial`` turns the overlapped decode steps off.
"""

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from arl.bench.gpu import _prompts, mixed_lengths, prepare_model
from arl.engines.base import SamplingParams
from arl.engines.hf import HFEngine


def busy_ms(events: list) -> float:
    """Milliseconds during which at least one kernel ran (the union of their intervals)."""
    total, start, end = 0.0, None, None
    for s, e in sorted((ev.time_range.start, ev.time_range.end) for ev in events):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        total += end - start
    return total / 1e3


def main() -> None:
    kind, batch, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    overlap = None if len(sys.argv) < 5 else sys.argv[4] != "serial"
    path = prepare_model("random", None, Path(tempfile.mkdtemp()))
    lengths = [128] * batch if kind == "uniform" else mixed_lengths(batch, 64, 1300 - new)
    longest = max(lengths)
    full = _prompts(batch, longest, 49152, seed=batch)
    prompts = [p[:n] for p, n in zip(full, lengths, strict=True)]
    sp = SamplingParams(max_new_tokens=new, temperature=1.0)
    options = dict(max_batch_size=batch, max_seq_len=longest + new + 8, overlap=overlap)
    options["max_prefill_tokens"] = max(8192, longest * batch)
    with HFEngine(path, device="cuda", dtype="bfloat16", **options) as eng:

        async def once() -> list:
            await eng.pause()  # every request queued first, so the batch starts together
            tasks = [asyncio.ensure_future(eng.agenerate(p, sp)) for p in prompts]
            await asyncio.sleep(0)
            await eng.resume()
            return await asyncio.gather(*tasks)

        def timed() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            asyncio.run(once())
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        asyncio.run(once())  # grows the cache
        asyncio.run(once())  # captures the graphs the timed runs use
        wall = statistics.mean(timed() for _ in range(3))
        print(
            f"{kind} b{batch} new{new} overlap={overlap}: ms/step {1e3 * wall / new:.2f}, "
            f"tok/s {batch * new / wall:,.0f}"
        )
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            wall = timed()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels) / 1e3
    print(
        f"profiled wall {wall * 1e3:.1f} ms (profiler on), kernel sum {total:.1f} ms, GPU busy "
        f"union {busy_ms(kernels):.1f} ms, kernels {len(kernels)}"
    )
    by_name: dict[str, list] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time / 1e3
    for name, (n, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"{ms:9.2f} ms {n:7d}  {name}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(table)


if __name__ == "__main__":
    main()
