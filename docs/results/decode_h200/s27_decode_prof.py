"""Profile a whole b256 generation of the hf engine (random SmolLM2-135M), mixed or uniform prompts:
kernel time by name, GPU busy vs wall, steps. argv: kind (mixed|uniform) batch new"""
import asyncio, sys, tempfile, time, statistics
from pathlib import Path
import torch
from torch.profiler import profile, ProfilerActivity
from arl.bench.gpu import prepare_model, _prompts, mixed_lengths
from arl.engines.base import SamplingParams
from arl.engines.hf import HFEngine

kind, batch, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
overlap = None if len(sys.argv) < 5 else sys.argv[4] != "serial"
tmp = tempfile.mkdtemp()
path = prepare_model("random", None, Path(tmp))
lengths = [128] * batch if kind == "uniform" else mixed_lengths(batch, 64, 1300 - new)
longest = max(lengths)
full = _prompts(batch, longest, 49152, seed=batch)
prompts = [p[:n] for p, n in zip(full, lengths)]
sp = SamplingParams(max_new_tokens=new, temperature=1.0)
with HFEngine(path, device="cuda", dtype="bfloat16", max_batch_size=batch, max_seq_len=longest + new + 8,
              max_prefill_tokens=max(8192, longest * batch), overlap=overlap) as eng:
    async def once():
        await eng.pause()
        tasks = [asyncio.ensure_future(eng.agenerate(p, sp)) for p in prompts]
        await asyncio.sleep(0)
        await eng.resume()
        return await asyncio.gather(*tasks)
    asyncio.run(once()); asyncio.run(once())
    walls = []
    for _ in range(3):
        torch.cuda.synchronize(); t0 = time.perf_counter(); asyncio.run(once()); torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    print(f"{kind} b{batch} new{new} overlap={overlap}: walls {[round(w,3) for w in walls]} -> ms/step {1e3*statistics.mean(walls)/new:.2f}, tok/s {batch*new/statistics.mean(walls):,.0f}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize(); t0 = time.perf_counter(); asyncio.run(once()); torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.device_time for e in ev) / 1e3  # ms, sums overlapping streams
    # union of kernel intervals
    iv = sorted((e.time_range.start, e.time_range.end) for e in ev)
    union, cur_s, cur_e = 0.0, None, None
    for s, e in iv:
        if cur_e is None or s > cur_e:
            if cur_e is not None: union += cur_e - cur_s
            cur_s, cur_e = s, e
        else: cur_e = max(cur_e, e)
    if cur_e is not None: union += cur_e - cur_s
    print(f"profiled wall {wall*1e3:.1f} ms (profiler on), kernel sum {busy:.1f} ms, GPU busy union {union/1e3:.1f} ms, kernels {len(ev)}")
    by = {}
    for e in ev:
        k = e.name[:90]; c = by.setdefault(k, [0, 0.0]); c[0] += 1; c[1] += e.device_time / 1e3
    for k, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"{t:9.2f} ms {n:7d}  {k}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
