"""Where a profiled step's GPU is idle: the union of its kernels' intervals in a torch.profiler
chrome trace (`arl.bench loop --profile-step N` writes trace_rank0.json), the gaps between them,
and the host ops that overlap the largest gaps. Session 31 ran it on the gsm8k update profiled
alone (`s31_h100_gsm8k_alternate_prof.*`); its output is s31_h100_update_gaps.txt.

    python docs/results/loop_h200/s31_trace_gaps.py TRACE.json[.gz]
"""

import gzip
import json
import sys

path = sys.argv[1]
with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
    events = json.load(f)["traceEvents"]
kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
t0, t_end = kernels[0]["ts"], max(e["ts"] + e["dur"] for e in kernels)
busy: list[list[float]] = []
for e in kernels:
    start, end = e["ts"], e["ts"] + e["dur"]
    if busy and start <= busy[-1][1]:
        busy[-1][1] = max(busy[-1][1], end)
    else:
        busy.append([start, end])
busy_ms = sum(b - a for a, b in busy) / 1e3
gaps = sorted(
    ((b[0] - a[1], a[1], b[0]) for a, b in zip(busy, busy[1:], strict=False)), reverse=True
)
print(f"{len(kernels)} kernels over {(t_end - t0) / 1e3:.1f} ms; busy {busy_ms:.1f} ms")
for lo, hi in ((1000, float("inf")), (50, 1000), (0, 50)):
    sel = [g for g in gaps if lo < g[0] <= hi]
    print(f"gaps {lo}-{hi} us: {len(sel)}, {sum(g[0] for g in sel) / 1e3:.1f} ms")
host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime")]
print("largest gaps, ms (at ms from the first kernel): the host ops overlapping them most")
for gap, start, end in gaps[:10]:
    near = [e for e in host if e["ts"] < end and e["ts"] + e["dur"] > start and e["dur"] <= 3 * gap]
    near.sort(key=lambda e: max(e["ts"], start) - min(e["ts"] + e["dur"], end))
    names = "; ".join(f"{e['name'][:48]} ({e['dur'] / 1e3:.1f})" for e in near[:4])
    print(f"{gap / 1e3:6.2f} at {(start - t0) / 1e3:7.1f}: {names}")
long = sorted((e for e in host if e["dur"] > 20000), key=lambda e: e["ts"])
print("host calls over 20 ms (blocked on a full launch queue or a copy waiting for the GPU):")
for e in long:
    print(f"  at {(e['ts'] - t0) / 1e3:7.1f} ms: {e['name'][:48]} {e['dur'] / 1e3:.1f} ms")
